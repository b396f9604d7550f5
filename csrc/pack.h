// The CUDA side of ec_nixl._C's pack(): plain types only, so pack.cu builds without torch headers.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace ec_nixl {

// One byte range to copy. Inputs are validated by the caller (ec_nixl_C.cpp).
struct PackSeg {
  const void* src;
  void* dst;
  int64_t nbytes;
};

// Segments per launch: the table travels by value in the kernel's parameters (2 KiB for 64),
// so a step needs no descriptor upload; more segments than this take ceil(n / 64) launches.
constexpr int kPackMaxSegs = 64;

// Enqueues the copies of segs[0, n) on `stream`. Returns the launch error, if any.
cudaError_t pack_launch(const PackSeg* segs, int n, cudaStream_t stream);

}  // namespace ec_nixl
