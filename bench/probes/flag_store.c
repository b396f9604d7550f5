// The host-side signal of bench/probes/waitvalue.py (variants E, H, N): a release store into a
// pinned, host-mapped word, then a store fence so a write-combined word leaves the WC buffers at
// once. Built by the probe itself (cc -O2 -shared -fPIC) and loaded with ctypes: an experiment
// stays out of the shipped extension.
#include <stdint.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

void flag_store(uint32_t *word, uint32_t value) {
  __atomic_store_n(word, value, __ATOMIC_RELEASE);
#if defined(__x86_64__) || defined(_M_X64)
  _mm_sfence();
#endif
}

uint32_t flag_load(const uint32_t *word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }
