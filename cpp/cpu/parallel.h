// Host-side helpers of the CPU FFI handlers: an IEEE floating-point environment guard and a deterministic
// parallel-for over independent work units.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <xmmintrin.h>
#define JF4_X86 1
#endif

#include "common/convert.cuh"

// The hot loops of the handlers are compiled three times (x86-64 baseline, AVX2, AVX-512) and the widest one the CPU
// runs is picked when the library loads (GCC function multiversioning, ifunc; glibc x86-64 only): JF4_CPU_CLONES on
// a loop's function, JF4_CPU_INLINE on the element helpers it calls so they are compiled into each clone. The
// results do not depend on the clone: the element arithmetic is IEEE binary32 with -ffp-contract=off either way.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && defined(__GLIBC__)
#define JF4_CPU_CLONES __attribute__((target_clones("default", "avx2", "arch=skylake-avx512")))
#else
#define JF4_CPU_CLONES
#endif
#if defined(__GNUC__)
#define JF4_CPU_INLINE __attribute__((always_inline)) inline
#else
#define JF4_CPU_INLINE inline
#endif

namespace jax_fp4 {
namespace cpu {

// XLA:CPU runs its computations with flush-to-zero / denormals-are-zero (and new threads inherit the creating
// thread's mode); the numeric contract keeps subnormals. The guard clears both modes for its scope and restores the
// caller's on exit.
class IeeeScope {
 public:
  IeeeScope() {
#if defined(JF4_X86)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~(0x8000u | 0x0040u));  // FTZ (bit 15), DAZ (bit 6)
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    fpcr &= ~(uint64_t(1) << 24);  // FZ
    __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr));
#endif
  }
  ~IeeeScope() {
#if defined(JF4_X86)
    _mm_setcsr(static_cast<unsigned>(saved_));
#elif defined(__aarch64__)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  IeeeScope(const IeeeScope&) = delete;
  IeeeScope& operator=(const IeeeScope&) = delete;

 private:
  uint64_t saved_ = 0;
};

// Runs fn(u) for every unit u in [0, n), split into contiguous ranges over up to hardware_concurrency threads (the
// caller's included), at most one thread per `min_work` of total `work` (elements). Every unit writes only its own
// outputs, so results do not depend on the number of threads. Each thread runs under an IeeeScope.
template <typename Fn>
void ParallelFor(int64_t n, int64_t work, int64_t min_work, const Fn& fn) {
  if (n <= 0) return;
  const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t by_work = std::max<int64_t>(1, work / std::max<int64_t>(1, min_work));
  const int64_t threads = std::min({hw, n, by_work});
  auto run = [&](int64_t t) {
    IeeeScope ieee;
    const int64_t b = n * t / threads, e = n * (t + 1) / threads;
    for (int64_t u = b; u < e; ++u) fn(u);
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(run, t);
  run(0);
  for (auto& th : pool) th.join();
}

// Input element -> fp32, exact (bf16: the upper half; f16: subnormals become fp32 normals; reference/_f32.widen).
JF4_CPU_INLINE float Widen(uint16_t h, bool bf16) {
  if (bf16) return cvt::Float(uint32_t(h) << 16);
  const uint32_t sign = uint32_t(h >> 15) << 31, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1F) return cvt::Float(sign | 0x7F800000u | (m << 13));
  if (e != 0) return cvt::Float(sign | ((e + 112u) << 23) | (m << 13));
  if (m == 0) return cvt::Float(sign);
  int p = 9;
  while (!((m >> p) & 1u)) --p;  // highest set bit: value m * 2^-24
  return cvt::Float(sign | (uint32_t(p + 103) << 23) | ((m << (23 - p)) & 0x7FFFFFu));
}

// n consecutive input elements of dtype `bytes` (2: bf16 when `bf16`, else f16; 4: f32) -> fp32.
JF4_CPU_INLINE void WidenRun(const void* src, int64_t n, int bytes, bool bf16, float* dst) {
  if (bytes == 4) {
    const float* s = static_cast<const float*>(src);
    std::copy(s, s + n, dst);
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(src);
  if (bf16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = cvt::Float(uint32_t(s[i]) << 16);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = Widen(s[i], false);
  }
}

}  // namespace cpu
}  // namespace jax_fp4
