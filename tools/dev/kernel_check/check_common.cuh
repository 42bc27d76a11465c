// Shared helpers of the kernel_check harnesses (quantize_check.cu, dequantize_check.cu, grouped_check.cu): CUDA error
// checks, back-to-back event timing, the device-to-device copy ceiling and the bf16 test input.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

namespace kernel_check {

// Best over `reps` rounds of `iters` back-to-back launch() calls (after 3 warm-up calls), in us per call; rounds
// before `first_rep` are not counted. launch() returns a cudaError_t.
template <typename Launch>
double BestUs(Launch launch, int iters, int reps = 3, int first_rep = 0) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) CK(launch());
  double best = 1e30;
  for (int rep = 0; rep < reps; ++rep) {
    CK(cudaEventRecord(e0));
    for (int i = 0; i < iters; ++i) CK(launch());
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (rep >= first_rep) best = std::fmin(best, 1e3 * ms / iters);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return best;
}

// us per cudaMemcpyAsync of `bytes` from src (or from a buffer of its own when src is null) to a scratch buffer.
inline double CopyUs(int64_t bytes, const void* src = nullptr) {
  void *x = nullptr, *y = nullptr;
  if (src == nullptr) {
    CK(cudaMalloc(&x, bytes));
    CK(cudaMemset(x, 1, bytes));
    src = x;
  }
  CK(cudaMalloc(&y, bytes));
  const double us = BestUs([&] { return cudaMemcpyAsync(y, src, bytes, cudaMemcpyDeviceToDevice); }, 20, 4, 1);
  cudaFree(x), cudaFree(y);
  return us;
}

// bf16 bits of f, rounded to nearest even (finite f).
inline uint16_t Bf16Rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// n bf16 bit patterns: normal values scaled by 2^[-30, 30] (one binade per 64 elements) plus 0.3 % edge values (NaN,
// +-inf, +-0, subnormals, bf16 max).
inline std::vector<uint16_t> MakeBf16Input(int64_t n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> bin(-30, 30), pick(0, 999);
  const uint16_t edge[] = {0x7FC0, 0xFFC1, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x7F7F, 0xFF7F};
  std::vector<uint16_t> h(n);
  int scale = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i % 64 == 0) scale = bin(g);
    if (pick(g) < 3) {
      h[i] = edge[(i / 7) % (sizeof(edge) / 2)];
    } else {
      h[i] = Bf16Rne(std::ldexp(nd(g), scale));
    }
  }
  return h;
}

// n bf16 values drawn from N(0, 1) (what benchmarks/ feed the kernels): every block has a normal E4M3 / E8M0 scale,
// no NaN or inf.
inline std::vector<uint16_t> MakeBf16Normal(int64_t n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> h(n);
  for (int64_t i = 0; i < n; ++i) h[i] = Bf16Rne(nd(g));
  return h;
}

// Command line `MODE[-normal] [DIR] [variant substring]` (DIR only for dump / compare); prints the device. Inputs are
// MakeBf16Input's binade mix with edge values, or with the -normal suffix MakeBf16Normal's (only where the harness
// passes normal_ok; elsewhere the suffix is an error, not silently ignored).
struct Cli {
  std::string mode, dir, only;
  bool check;  // dump or compare
  bool normal = false;
};

inline Cli ParseCli(int argc, char** argv, bool normal_ok = false) {
  Cli c;
  c.mode = argc > 1 ? argv[1] : "time";
  const std::string suffix = "-normal";
  if (c.mode.size() > suffix.size() && c.mode.compare(c.mode.size() - suffix.size(), suffix.size(), suffix) == 0) {
    c.normal = true;
    c.mode.resize(c.mode.size() - suffix.size());
    if (!normal_ok) {
      std::fprintf(stderr, "this harness has no -normal input (mode %s)\n", argv[1]);
      std::exit(2);
    }
  }
  c.check = c.mode == "dump" || c.mode == "compare";
  c.dir = c.check && argc > 2 ? argv[2] : ".";
  c.only = argc > (c.check ? 3 : 2) ? argv[c.check ? 3 : 2] : "";
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  return c;
}

// Compares each part of `got` with the next bytes of f (a dump of the same parts); prints a MISMATCH line per
// differing part (names[i] the part, `label` the variant and case) and returns how many differ.
inline int CompareParts(FILE* f, const std::vector<std::vector<uint8_t>>& got, const char* const* names,
                        const std::string& label) {
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    std::vector<uint8_t> want(got[i].size());
    if (std::fread(want.data(), 1, want.size(), f) != want.size()) std::memset(want.data(), 0xEE, want.size());
    size_t diff = 0, first = 0;
    for (size_t j = 0; j < want.size(); ++j) {
      if (want[j] != got[i][j] && diff++ == 0) first = j;
    }
    if (diff) {
      std::printf("  MISMATCH %s %s: %zu of %zu bytes differ, first at %zu (%02x vs %02x)\n", label.c_str(), names[i],
                  diff, want.size(), first, want[first], got[i][first]);
      ++bad;
    }
  }
  return bad;
}

}  // namespace kernel_check
