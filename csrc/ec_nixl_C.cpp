// ec_nixl._C: native fast paths behind ec_nixl/native.py (which has a Python fallback for each).
//
//   pack(srcs, dst, dst_offsets)   copy N contiguous tensors' bytes into one uint8 tensor at byte
//                                  offsets: one kernel launch on the current stream (CUDA), or a
//                                  memcpy loop (CPU).
//
// The CUDA build links only the CUDA runtime that torch already loads (no libcuda.so).

#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

#ifdef EC_NIXL_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "pack.h"
#endif

namespace {

struct Seg {
  const at::Tensor* src;
  int64_t offset;
  int64_t nbytes;
};

// The checks shared by both devices; error texts match native.pack_python's.
std::vector<Seg> check_pack(const std::vector<at::Tensor>& srcs, const at::Tensor& dst,
                            const std::vector<int64_t>& offsets) {
  TORCH_CHECK_VALUE(dst.scalar_type() == at::kByte, "pack: dst must be uint8, got ", dst.scalar_type());
  TORCH_CHECK_VALUE(dst.is_contiguous(), "pack: dst must be contiguous");
  TORCH_CHECK_VALUE(srcs.size() == offsets.size(), "pack: got ", srcs.size(), " tensors but ",
                    offsets.size(), " offsets");
  const int64_t cap = dst.numel();
  std::vector<Seg> segs;
  segs.reserve(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) {
    const at::Tensor& s = srcs[i];
    TORCH_CHECK_VALUE(s.device() == dst.device(), "pack: srcs[", i, "] is on ", s.device(),
                      " but dst is on ", dst.device());
    TORCH_CHECK_VALUE(s.is_contiguous(), "pack: srcs[", i, "] is not contiguous");
    const int64_t nbytes = s.numel() * static_cast<int64_t>(s.element_size());
    const int64_t off = offsets[i];
    TORCH_CHECK_VALUE(off >= 0 && off <= cap && nbytes <= cap - off, "pack: srcs[", i, "] (", nbytes,
                      " bytes at offset ", off, ") does not fit in dst (", cap, " bytes)");
    segs.push_back({&s, off, nbytes});
  }
  // Overlapping destination ranges would race on the GPU: refuse them.
  std::vector<size_t> order(segs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return segs[a].offset < segs[b].offset; });
  int64_t end = 0;
  size_t last = 0;
  bool any = false;
  for (size_t i : order) {
    if (segs[i].nbytes == 0) continue;
    TORCH_CHECK_VALUE(!any || segs[i].offset >= end, "pack: destination ranges of srcs[", last, "] and srcs[",
                      i, "] overlap");
    end = segs[i].offset + segs[i].nbytes;
    last = i;
    any = true;
  }
  return segs;
}

void pack(const std::vector<at::Tensor>& srcs, at::Tensor dst, const std::vector<int64_t>& offsets) {
  const std::vector<Seg> segs = check_pack(srcs, dst, offsets);
#ifdef EC_NIXL_WITH_CUDA
  TORCH_CHECK_VALUE(dst.is_cpu() || dst.is_cuda(), "pack: unsupported device ", dst.device());
#else
  TORCH_CHECK_VALUE(dst.is_cpu(), "pack: this build of ec_nixl._C supports CPU tensors only, got ", dst.device());
#endif
  uint8_t* base = static_cast<uint8_t*>(dst.data_ptr());
  if (dst.is_cpu()) {
    pybind11::gil_scoped_release nogil;  // large CPU copies should not hold the GIL
    for (const Seg& g : segs) {
      const void* src = g.src->data_ptr();
      if (g.nbytes > 0 && src != base + g.offset) std::memcpy(base + g.offset, src, g.nbytes);
    }
    return;
  }
#ifdef EC_NIXL_WITH_CUDA
  std::vector<ec_nixl::PackSeg> table;
  table.reserve(segs.size());
  for (const Seg& g : segs) {
    const void* src = g.src->data_ptr();
    if (g.nbytes > 0 && src != base + g.offset) table.push_back({src, base + g.offset, g.nbytes});
  }
  if (table.empty()) return;
  const c10::cuda::CUDAGuard guard(dst.device());
  const cudaError_t err = ec_nixl::pack_launch(table.data(), static_cast<int>(table.size()),
                                               c10::cuda::getCurrentCUDAStream(dst.device().index()).stream());
  TORCH_CHECK(err == cudaSuccess, "pack: kernel launch failed: ", cudaGetErrorString(err));
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ec-nixl native fast paths (see csrc/README.md)";
  m.def("pack", &pack, "Copy each src's bytes into the uint8 tensor dst at dst_offsets[i] (one launch on CUDA)",
        pybind11::arg("srcs"), pybind11::arg("dst"), pybind11::arg("dst_offsets"));
#ifdef EC_NIXL_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
#ifdef EC_NIXL_TORCH_VERSION
  m.attr("BUILT_FOR_TORCH") = EC_NIXL_TORCH_VERSION;  // ec_nixl.native refuses another torch
#endif
}
