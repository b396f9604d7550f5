// pack(): copy a step's encoder outputs into the arena with one kernel launch.
//
// Why: N separate copy_ calls cost N launches (~5 us of host time each) on the runner thread; one
// launch over all bytes of all segments costs one. Each block copies one 16 KiB chunk of one
// segment; the segment table (with each segment's first chunk) is a kernel parameter, so there is
// no descriptor upload and nothing to keep alive after the launch.

#include "pack.h"

#include <algorithm>

namespace ec_nixl {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 16 * 1024;  // bytes per block; a multiple of 16

struct Seg {
  const uint8_t* src;
  uint8_t* dst;
  int64_t nbytes;
  int64_t first_chunk;  // index of this segment's first block in the grid
};

struct Table {
  Seg seg[kPackMaxSegs];
  int n;
};

// __grid_constant__: index the table in parameter memory without a per-thread local copy.
__global__ void __launch_bounds__(kThreads) pack_kernel(const __grid_constant__ Table t) {
  // Which segment does this block belong to? The last one whose first chunk is <= blockIdx.x.
  const int64_t b = blockIdx.x;
  int lo = 0, hi = t.n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.seg[mid].first_chunk <= b) lo = mid; else hi = mid - 1;
  }
  const Seg& g = t.seg[lo];
  const int64_t begin = (b - g.first_chunk) * kChunk;
  const int64_t n = min(kChunk, g.nbytes - begin);
  const uint8_t* src = g.src + begin;
  uint8_t* dst = g.dst + begin;

  int64_t done = 0;
  // Chunks start at multiples of 16 from the segment start, so a 16-byte aligned segment gives
  // 16-byte aligned chunks: copy those with 16-byte vectors, and only the tail bytewise.
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
    const int64_t nvec = n / 16;
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < nvec; i += kThreads) d4[i] = s4[i];
    done = nvec * 16;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += kThreads) dst[i] = src[i];
}

}  // namespace

cudaError_t pack_launch(const PackSeg* segs, int n, cudaStream_t stream) {
  for (int base = 0; base < n; base += kPackMaxSegs) {
    Table t;
    t.n = 0;
    int64_t chunks = 0;
    for (int i = base; i < std::min(n, base + kPackMaxSegs); ++i) {
      if (segs[i].nbytes <= 0) continue;  // empty segments get no blocks
      t.seg[t.n++] = Seg{static_cast<const uint8_t*>(segs[i].src), static_cast<uint8_t*>(segs[i].dst),
                         segs[i].nbytes, chunks};
      chunks += (segs[i].nbytes + kChunk - 1) / kChunk;
    }
    if (chunks == 0) continue;
    if (chunks > 0x7fffffff) return cudaErrorInvalidValue;  // > 32 TiB in one launch
    pack_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(t);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace ec_nixl
