// ec_nixl._C: native fast paths behind ec_nixl/native.py (which has a Python fallback for each).
//
//   pack(srcs, dst, dst_offsets)   copy N contiguous tensors' bytes into one uint8 tensor at byte
//                                  offsets: one kernel launch on the current stream (CUDA), or a
//                                  memcpy loop (CPU).
//   flag_* / stream_*_value32      CUDA builds only (EC_NIXL_WITH_CUDA): 32-bit words in pinned,
//                                  host-mapped memory that a stream can wait on (cuStreamWaitValue32),
//                                  so a host thread can release queued GPU work without blocking
//                                  the thread that queued it. See DeviceFlag in native.py for the
//                                  hazards.
//
// The driver calls are resolved at run time through cudaGetDriverEntryPointByVersion, so the
// extension links only the CUDA runtime that torch already loads (no libcuda.so at build time).

#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

#ifdef EC_NIXL_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime.h>

#include "pack.h"
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
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

#ifdef EC_NIXL_WITH_CUDA
// ------------------------------------------------------------------------------------------------
// Device flags.

using PfnWaitWrite = CUresult(CUDAAPI*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using PfnCtxGetCurrent = CUresult(CUDAAPI*)(CUcontext*);

template <typename F>
F driver_fn(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  const cudaError_t err = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &status);
#else
  const cudaError_t err = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &status);
#endif
  TORCH_CHECK(err == cudaSuccess && status == cudaDriverEntryPointSuccess && fn != nullptr,
              "ec_nixl._C: driver function ", name, " not available (", cudaGetErrorString(err), ")");
  return reinterpret_cast<F>(fn);
}

void check_cu(CUresult r, const char* what) {
  TORCH_CHECK(r == CUDA_SUCCESS, "ec_nixl._C: ", what, " failed with CUresult ", static_cast<int>(r));
}

void check_rt(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "ec_nixl._C: ", what, " failed: ", cudaGetErrorString(e));
}

// Driver calls need a current context; a thread that never ran a runtime call has none.
void ensure_context(int64_t device) {
  static const PfnCtxGetCurrent get_current = driver_fn<PfnCtxGetCurrent>("cuCtxGetCurrent");
  CUcontext ctx = nullptr;
  check_cu(get_current(&ctx), "cuCtxGetCurrent");
  if (ctx == nullptr) {
    int dev = static_cast<int>(device);
    if (dev < 0) check_rt(cudaGetDevice(&dev), "cudaGetDevice");
    check_rt(cudaSetDevice(dev), "cudaSetDevice");  // binds the primary context (CUDA >= 12)
  }
}

// n zeroed 32-bit words of pinned host memory mapped into every context's address space.
// Returns (host_ptr, dev_ptr); free with flag_free(host_ptr) once no stream can still wait on them.
std::tuple<int64_t, int64_t> flag_alloc(int64_t n, int64_t device, bool write_combined) {
  TORCH_CHECK_VALUE(n > 0, "flag_alloc: n must be positive");
  ensure_context(device);
  void* host = nullptr;
  unsigned flags = cudaHostAllocMapped | cudaHostAllocPortable;
  if (write_combined) flags |= cudaHostAllocWriteCombined;
  check_rt(cudaHostAlloc(&host, static_cast<size_t>(n) * 4, flags), "cudaHostAlloc");
  std::memset(host, 0, static_cast<size_t>(n) * 4);
  void* dev = nullptr;
  const cudaError_t e = cudaHostGetDevicePointer(&dev, host, 0);
  if (e != cudaSuccess) cudaFreeHost(host);
  check_rt(e, "cudaHostGetDevicePointer");
  return {reinterpret_cast<int64_t>(host), reinterpret_cast<int64_t>(dev)};
}

void flag_free(int64_t host_ptr) { check_rt(cudaFreeHost(reinterpret_cast<void*>(host_ptr)), "cudaFreeHost"); }

// Enqueue on `stream`: block later work until the word at dev_ptr satisfies `flags` against
// `value` (CU_STREAM_WAIT_VALUE_GEQ = 0 by default: cyclic (int32)(*addr - value) >= 0).
void stream_wait_value32(int64_t stream, int64_t dev_ptr, int64_t value, int64_t flags, int64_t device) {
  static const PfnWaitWrite wait = driver_fn<PfnWaitWrite>("cuStreamWaitValue32");
  ensure_context(device);
  check_cu(wait(reinterpret_cast<CUstream>(stream), static_cast<CUdeviceptr>(dev_ptr),
                static_cast<cuuint32_t>(value), static_cast<unsigned>(flags)),
           "cuStreamWaitValue32");
}

// Enqueue on `stream`: write `value` to the word at dev_ptr (a device-side signal).
void stream_write_value32(int64_t stream, int64_t dev_ptr, int64_t value, int64_t device) {
  static const PfnWaitWrite write = driver_fn<PfnWaitWrite>("cuStreamWriteValue32");
  ensure_context(device);
  check_cu(write(reinterpret_cast<CUstream>(stream), static_cast<CUdeviceptr>(dev_ptr),
                 static_cast<cuuint32_t>(value), CU_STREAM_WRITE_VALUE_DEFAULT),
           "cuStreamWriteValue32");
}

// Host-side signal: a release store (everything the host wrote before is visible first), then a
// store fence so the word leaves write-combining buffers at once if the memory is write-combined.
void flag_store(int64_t host_ptr, int64_t value) {
  __atomic_store_n(reinterpret_cast<uint32_t*>(host_ptr), static_cast<uint32_t>(value), __ATOMIC_RELEASE);
#if defined(__x86_64__) || defined(_M_X64)
  _mm_sfence();
#endif
}

int64_t flag_load(int64_t host_ptr) {
  return __atomic_load_n(reinterpret_cast<const uint32_t*>(host_ptr), __ATOMIC_ACQUIRE);
}
#endif  // EC_NIXL_WITH_CUDA

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ec-nixl native fast paths (see csrc/README.md)";
  m.def("pack", &pack, "Copy each src's bytes into the uint8 tensor dst at dst_offsets[i] (one launch on CUDA)",
        pybind11::arg("srcs"), pybind11::arg("dst"), pybind11::arg("dst_offsets"));
#ifdef EC_NIXL_WITH_CUDA
  m.attr("WITH_CUDA") = true;
  m.attr("WAIT_GEQ") = static_cast<int>(CU_STREAM_WAIT_VALUE_GEQ);
  m.attr("WAIT_EQ") = static_cast<int>(CU_STREAM_WAIT_VALUE_EQ);
  m.def("flag_alloc", &flag_alloc, "n pinned host-mapped uint32 words -> (host_ptr, dev_ptr)", pybind11::arg("n"),
        pybind11::arg("device") = -1, pybind11::arg("write_combined") = false);
  m.def("flag_free", &flag_free, pybind11::arg("host_ptr"));
  m.def("stream_wait_value32", &stream_wait_value32, pybind11::arg("stream"), pybind11::arg("dev_ptr"),
        pybind11::arg("value"), pybind11::arg("flags") = 0, pybind11::arg("device") = -1);
  m.def("stream_write_value32", &stream_write_value32, pybind11::arg("stream"), pybind11::arg("dev_ptr"),
        pybind11::arg("value"), pybind11::arg("device") = -1);
  m.def("flag_store", &flag_store, "release-store value into the word at host_ptr", pybind11::arg("host_ptr"),
        pybind11::arg("value"));
  m.def("flag_load", &flag_load, pybind11::arg("host_ptr"));
#else
  m.attr("WITH_CUDA") = false;
#endif
}
