// Standalone A/B check and timing of the jf4_dequantize and jf4_swizzle / jf4_unswizzle kernels without JAX (a
// development tool for ncu profiling and kernel work; the project's tests and benchmarks go through JAX).
//
// Build it twice, against the kernel headers of a known-good revision and of the working tree; `dump DIR` with the
// first writes every output (all variants of kVariants on the check shapes; random code bytes — every E2M1 / E4M3 /
// E5M2 code, NaN scales included —, random tensor and window amaxes; outputs poisoned before each run), `compare DIR`
// with the second checks every output byte against those files. `time` times the launches against a
// device-to-device copy (CUDA events, back-to-back launches; scales drawn from the range quantize produces);
// `profile` launches each variant once at 8192x8192 (for ncu).
//
// Build: nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -ftz=false -Icpp -o dqcheck
//            tools/dev/kernel_check/dequantize_check.cu
// Run:   ./dqcheck dump|compare DIR [variant substring]  |  ./dqcheck time|profile [variant substring]
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check_common.cuh"
#include "dequantize/dequantize.cuh"
#include "swizzle/swizzle.cuh"

namespace dq = jax_fp4::dequantize;


enum OutType { kF32 = 0, kBf16 = 1, kF16 = 2 };
enum Op { kDequantize = 0, kSwizzleOp = 1, kUnswizzleOp = 2 };

struct Variant {
  const char* name;
  int kind, flags, out;
  bool tensor_amax;  // NVFP4 1D/2D/RHT with its amax (else block scales only)
  int op = kDequantize;
};

constexpr int kNv = dq::kNvfp4, kE4 = dq::kMxfp8E4m3, kE5 = dq::kMxfp8E5m2;
constexpr int kT = dq::kTransposeOut, kS = dq::kSwizzled, kR = dq::kRht, kL = dq::k1x64, kMc = dq::kMxColumnwise;

const Variant kVariants[] = {
    {"nvfp4 row bf16", kNv, 0, kBf16, true},
    {"nvfp4 row f32", kNv, 0, kF32, true},
    {"nvfp4 row f16", kNv, 0, kF16, true},
    {"nvfp4 row blockonly bf16", kNv, 0, kBf16, false},
    {"nvfp4 row swz bf16", kNv, kS, kBf16, true},
    {"nvfp4 col bf16", kNv, kT, kBf16, true},
    {"nvfp4 col f32", kNv, kT, kF32, true},
    {"nvfp4 col f16", kNv, kT, kF16, true},
    {"nvfp4 col blockonly bf16", kNv, kT, kBf16, false},
    {"nvfp4 col swz bf16", kNv, kT | kS, kBf16, true},
    {"nvfp4 RHT row bf16", kNv, kR, kBf16, true},
    {"nvfp4 RHT col bf16", kNv, kR | kT, kBf16, true},
    {"nvfp4 RHT col f32", kNv, kR | kT, kF32, true},
    {"nvfp4 RHT col swz f16", kNv, kR | kT | kS, kF16, true},
    {"nvfp4 RHT col f16", kNv, kR | kT, kF16, true},
    {"nvfp4 RHT col swz bf16", kNv, kR | kT | kS, kBf16, true},
    {"nvfp4 1x64 row bf16", kNv, kL, kBf16, false},
    {"nvfp4 1x64 row f32", kNv, kL, kF32, false},
    {"nvfp4 1x64 row swz bf16", kNv, kL | kS, kBf16, false},
    {"nvfp4 1x64 col bf16", kNv, kL | kT, kBf16, false},
    {"mxfp8 row bf16", kE4, 0, kBf16, false},
    {"mxfp8 row swz bf16", kE4, kS, kBf16, false},
    {"mxfp8 col bf16", kE4, kMc, kBf16, false},
    {"mxfp8 col swz bf16", kE4, kMc | kS, kBf16, false},
    {"e5m2 row f32", kE5, 0, kF32, false},
    {"e5m2 col f16", kE5, kMc, kF16, false},
    {"e5m2 col swz f32", kE5, kMc | kS, kF32, false},
    {"swizzle nvfp4 scales", kNv, 0, kBf16, false, kSwizzleOp},
    {"unswizzle nvfp4 scales", kNv, kS, kBf16, false, kUnswizzleOp},
    {"swizzle mxfp8 col scales", kE4, kMc, kBf16, false, kSwizzleOp},
};

struct Shape {
  int64_t P, R, C;
};

int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
int OutSize(int out) { return out == kF32 ? 4 : 2; }

// Scale matrix geometry: [rows, cols] compact.
void ScaleGeometry(const Variant& v, const Shape& s, int64_t& rows, int64_t& cols) {
  const bool col = v.flags & kMc;
  const int64_t bs = v.kind == kNv ? 16 : 32;
  rows = col ? s.P * s.C : s.P * s.R;
  cols = col ? s.R / bs : s.C / bs;
}

bool Applies(const Variant& v, const Shape& s) {
  if (v.kind == kNv) return s.C % ((v.flags & kL) ? 64 : 16) == 0;
  return (v.flags & kMc) ? s.R % 32 == 0 : s.C % 32 == 0;
}

struct Run {
  uint8_t *data = nullptr, *scale = nullptr, *out = nullptr;
  float *amax = nullptr, *wamax = nullptr;
  size_t data_bytes = 0, scale_bytes = 0, out_bytes = 0, in_bytes = 0;
  int64_t scale_rows = 0, scale_cols = 0;
  dq::Args a{};
  jax_fp4::swizzle::Geometry g{};
};

template <typename T>
T* Upload(const std::vector<T>& h) {
  T* d;
  CK(cudaMalloc(reinterpret_cast<void**>(&d), h.size() * sizeof(T) + 16));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

Run Setup(const Variant& v, const Shape& s, bool realistic, uint64_t seed) {
  std::mt19937_64 g(seed);
  Run r;
  const int64_t n = s.P * s.R * s.C;
  r.data_bytes = v.kind == kNv ? n / 2 : n;
  ScaleGeometry(v, s, r.scale_rows, r.scale_cols);
  const bool swz_in = (v.flags & kS) != 0;
  const int64_t compact = r.scale_rows * r.scale_cols;
  const int64_t padded = RoundUp(r.scale_rows, 128) * RoundUp(r.scale_cols, 4);
  r.scale_bytes = swz_in ? padded : compact;
  std::vector<uint8_t> data(r.data_bytes), scale(r.scale_bytes);
  std::uniform_int_distribution<int> byte(0, 255), e4m3(0x20, 0x70), e8m0(100, 150);
  for (auto& b : data) b = uint8_t(byte(g));
  for (auto& b : scale) b = uint8_t(realistic ? (v.kind == kNv ? e4m3(g) : e8m0(g)) : byte(g));
  r.data = Upload(data);
  r.scale = Upload(scale);
  std::uniform_real_distribution<float> u(-30.0f, 30.0f);
  std::vector<float> amax(s.P);
  for (auto& f : amax) f = std::ldexp(1.0f + 0.5f * std::abs(u(g)), int(u(g)));
  r.amax = Upload(amax);
  if (v.flags & kL) {
    std::vector<float> w(s.P * s.R * (s.C / 64));
    for (size_t i = 0; i < w.size(); ++i) {
      const int pick = byte(g);
      w[i] = pick < 4 ? 0.0f : (pick < 8 && !realistic ? std::ldexp(1.0f, -140 + pick) : std::ldexp(1.0f + 0.5f *
             std::abs(u(g)), int(realistic ? u(g) / 3 : u(g) * 4)));
      if (!realistic && pick >= 250) w[i] = pick == 250 ? INFINITY : pick == 251 ? NAN : pick == 252 ? -1.0f : 3e38f;
    }
    r.wamax = Upload(w);
  }
  if (v.op == kDequantize) {
    r.out_bytes = n * OutSize(v.out);
    r.in_bytes = r.data_bytes + r.scale_bytes + (v.tensor_amax ? 4 * s.P : 0) + ((v.flags & kL) ? 4 * n / 64 : 0);
  } else {
    r.out_bytes = v.op == kSwizzleOp ? padded : compact;
    r.in_bytes = v.op == kSwizzleOp ? compact : padded;
  }
  CK(cudaMalloc(reinterpret_cast<void**>(&r.out), r.out_bytes + 16));
  dq::Args& a = r.a;
  a.data = r.data, a.scale = r.scale, a.out = r.out;
  a.amax = v.tensor_amax ? r.amax : nullptr;
  a.window_amax = r.wamax;
  a.P = s.P, a.R = s.R, a.C = s.C;
  a.flags = v.flags | (v.kind == kNv && !(v.flags & kL) && !v.tensor_amax ? dq::kBlockOnly : 0);
  a.amax_per_p = v.tensor_amax && s.P > 1;
  a.scale_cols_padded = RoundUp(r.scale_cols, 4);
  r.g = jax_fp4::swizzle::MakeGeometry(r.scale_rows, r.scale_cols, v.op == kSwizzleOp ? r.scale : r.out);
  return r;
}

void Free(Run& r) {
  cudaFree(r.data), cudaFree(r.scale), cudaFree(r.out), cudaFree(r.amax), cudaFree(r.wamax);
}

cudaError_t Launch(const Variant& v, const Run& r) {
  if (v.op == kSwizzleOp) return jax_fp4::swizzle::LaunchSwizzle(r.scale, r.out, 1, r.g, 0);
  if (v.op == kUnswizzleOp) return jax_fp4::swizzle::LaunchUnswizzle(r.scale, r.out, 1, r.g, 0);
#define JF4_KIND(T)                                                   \
  switch (v.kind) {                                                   \
    case kNv: return dq::Launch<T, kNv>(r.a, 0);                      \
    case kE4: return dq::Launch<T, kE4>(r.a, 0);                      \
    default: return dq::Launch<T, kE5>(r.a, 0);                       \
  }
  if (v.out == kF32) JF4_KIND(float)
  if (v.out == kBf16) JF4_KIND(__nv_bfloat16)
  JF4_KIND(__half)
#undef JF4_KIND
}

int main(int argc, char** argv) {
  const kernel_check::Cli cli = kernel_check::ParseCli(argc, argv);
  const std::string &mode = cli.mode, &dir = cli.dir, &only = cli.only;
  const bool check = cli.check;
  std::vector<Shape> shapes;
  if (check) {
    shapes = {{1, 256, 256}, {3, 96, 192}, {2, 200, 160}, {1, 100, 320}, {1, 1000, 1024}, {2, 64, 64},
              {1, 130, 96}, {1, 384, 4160}, {4, 128, 128}, {1, 32, 48}};
  } else if (mode == "time") {
    shapes = {{1, 8192, 8192}, {1, 16384, 4096}, {1, 16384, 14336}};
  } else {
    shapes = {{1, 8192, 8192}};
  }
  int failures = 0;
  for (const Shape& s : shapes) {
    const int64_t n = s.P * s.R * s.C;
    double copy_us = 0;
    if (!check) {
      copy_us = kernel_check::CopyUs(n * 2);
      std::printf("[%lldx%lldx%lld] copy of bf16 x %.1f us = %.2f TB/s (read + write)\n", (long long)s.P,
                  (long long)s.R, (long long)s.C, copy_us, 4.0 * n / copy_us / 1e6);
    }
    for (const Variant& v : kVariants) {
      if (!only.empty() && std::string(v.name).find(only) == std::string::npos) continue;
      if (!Applies(v, s)) continue;
      Run r = Setup(v, s, !check, 77 + n + v.flags * 13 + v.kind);
      if (check) {
        CK(cudaMemset(r.out, mode == "dump" ? 0xA5 : 0x5A, r.out_bytes));
        CK(Launch(v, r));
        CK(cudaDeviceSynchronize());
        std::vector<uint8_t> got(r.out_bytes);
        CK(cudaMemcpy(got.data(), r.out, r.out_bytes, cudaMemcpyDeviceToHost));
        char fname[512];
        std::snprintf(fname, sizeof(fname), "%s/%s_%lld_%lld_%lld.bin", dir.c_str(), v.name, (long long)s.P,
                      (long long)s.R, (long long)s.C);
        for (char* c = fname + dir.size() + 1; *c; ++c) {
          if (*c == ' ' || *c == '+') *c = '_';
        }
        if (mode == "dump") {
          FILE* f = std::fopen(fname, "wb");
          std::fwrite(got.data(), 1, got.size(), f);
          std::fclose(f);
        } else {
          FILE* f = std::fopen(fname, "rb");
          std::vector<uint8_t> want(got.size(), 0xEE);
          const bool have = f && std::fread(want.data(), 1, want.size(), f) == want.size();
          if (f) std::fclose(f);
          size_t diff = 0, first = 0;
          for (size_t j = 0; j < want.size(); ++j) {
            if (want[j] != got[j] && diff++ == 0) first = j;
          }
          std::printf("%-28s [%lld,%lld,%lld] %s", v.name, (long long)s.P, (long long)s.R, (long long)s.C,
                      !have ? "MISSING\n" : diff ? "DIFFERS" : "bit-exact\n");
          if (have && diff) std::printf(": %zu of %zu bytes, first at %zu (%02x vs %02x)\n", diff, want.size(), first,
                                        want[first], got[first]);
          failures += !have || diff;
        }
      } else if (mode == "time") {
        const double t = kernel_check::BestUs([&] { return Launch(v, r); }, 20);
        const double bytes = double(r.in_bytes + r.out_bytes);
        const double ceil_bps = 4.0 * n / copy_us * 1e6;
        std::printf("  %-28s %8.1f us %7.0f GB/s %5.1f%% of copy", v.name, t, bytes / (t * 1e-6) / 1e9,
                    100 * bytes / (t * 1e-6) / ceil_bps);
        if (v.op != kDequantize) {  // small matrices: also against a copy of the same bytes
          const double same = kernel_check::CopyUs(int64_t(r.in_bytes));
          std::printf("  (copy of the %.1f MB input: %.1f us)", r.in_bytes / 1e6, same);
        }
        std::printf("\n");
      } else {
        CK(Launch(v, r));
        CK(cudaDeviceSynchronize());
      }
      Free(r);
    }
  }
  if (mode == "compare") std::printf("%s: %d variant/shape pairs differ\n", failures ? "FAIL" : "OK", failures);
  return failures ? 1 : 0;
}
