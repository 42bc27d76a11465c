// Standalone A/B check and timing of the jf4_quantize kernel without JAX (a development tool for ncu profiling and
// kernel work; the project's tests and benchmarks go through JAX).
//
// Build it twice, against the kernel headers of a known-good revision and of the working tree; `dump DIR` with the
// first writes every output (all variants of kVariants on the check shapes; bf16 input of random values over many
// binades plus NaN, +-inf, +-0, subnormals, bf16 max; outputs poisoned before each run), `compare DIR` with the second
// checks every output byte against those files. `time` times quantize::Launch against a device-to-device copy of x
// (CUDA events, back-to-back launches); `profile` launches each variant once at 8192x8192 (for ncu). With the -normal
// suffix (dump-normal, compare-normal, time-normal, profile-normal) the input is N(0, 1) in bf16 instead, as in
// benchmarks/quantize.py: no NaN / inf, and every block's E4M3 scale normal (the default input spans 2^-30 .. 2^30 and
// holds infs, so most NVFP4 blocks get saturated or subnormal scales: a worst case, not a typical one).
//
// Build: nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -ftz=false -Icpp -o qcheck \
//            tools/dev/kernel_check/quantize_check.cu
// Run:   ./qcheck dump|compare DIR [variant substring]  |  ./qcheck time|profile [variant substring]
#include <cuda_bf16.h>
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
#include "quantize/quantize.cuh"

using namespace jax_fp4::quantize;


struct Variant {
  const char* name;
  int row, col, row_opts, col_opts;
  bool swizzled, dbias;
  bool row_exact = false, col_exact = false;  // bf16 GEMM-emulation operands instead of codes (Args::row_exact)
};

const Variant kVariants[] = {
    {"nvfp4 row", kNvfp4, kNone, 0, 0, false, false},
    {"nvfp4 col", kNone, kNvfp4, 0, 0, false, false},
    {"nvfp4 row+col", kNvfp4, kNvfp4, 0, 0, false, false},
    {"mxfp8 row", kMxfp8E4m3, kNone, 0, 0, false, false},
    {"mxfp8 col", kNone, kMxfp8E4m3, 0, 0, false, false},
    {"mxfp8 row+col", kMxfp8E4m3, kMxfp8E4m3, 0, 0, false, false},
    {"mixed nvfp4 row + mxfp8 col", kNvfp4, kMxfp8E4m3, 0, 0, false, false},
    {"mxfp8 row+col dbias", kMxfp8E4m3, kMxfp8E4m3, 0, 0, false, true},
    {"e5m2 row+col dbias", kMxfp8E5m2, kMxfp8E5m2, 0, 0, false, true},
    {"nvfp4 2D row+col", kNvfp4, kNvfp4, k2d, k2d, false, false},
    {"nvfp4 RHT col", kNone, kNvfp4, 0, kRht, false, false},
    {"nvfp4 SR row+col", kNvfp4, kNvfp4, kSr, kSr, false, false},
    {"nvfp4 SR+RHT col dbias", kNone, kNvfp4, 0, kSr | kRht, false, true},
    {"nvfp4 1x64 row+col", kNvfp4, kNvfp4, k1x64, k1x64, false, false},
    {"nvfp4 row+col swizzled", kNvfp4, kNvfp4, 0, 0, true, false},
    {"mxfp8 row+col swizzled", kMxfp8E4m3, kMxfp8E4m3, 0, 0, true, false},
    {"mixed swizzled", kNvfp4, kMxfp8E4m3, 0, 0, true, false},
    // The dense layer's fused passes on an emulated GEMM: x (exact NVFP4 / MXFP8 rowwise for fprop, MXFP8 columnwise
    // codes for wgrad) and dy (both MXFP8 orientations exact, dbias).
    {"exact mixed: nvfp4 row exact", kNvfp4, kMxfp8E4m3, 0, 0, false, false, true, false},
    {"exact mxfp8 row exact + col", kMxfp8E4m3, kMxfp8E4m3, 0, 0, false, false, true, false},
    {"exact mxfp8 both exact dbias", kMxfp8E4m3, kMxfp8E4m3, 0, 0, false, true, true, true},
    {"exact nvfp4 SR row+RHT col", kNvfp4, kNvfp4, kSr, kSr | kRht, false, false, true, true},
};

struct Shape {
  int64_t P, M, K;
};

int Block(int kind) { return kind == kNvfp4 ? 16 : 32; }
int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Output buffers of one orientation (sizes as the FFI handler checks them).
struct Out {
  uint8_t* data = nullptr;
  uint8_t* scale = nullptr;
  float* wamax = nullptr;
  size_t data_bytes = 0, scale_bytes = 0, wamax_bytes = 0;
  int64_t cols_padded = 0;
};

bool Applies(const Variant& v, const Shape& s) {
  if (v.row != kNone && s.K % (v.row_opts & k1x64 ? 64 : Block(v.row))) return false;
  if (v.col != kNone && s.M % (v.col_opts & k1x64 ? 64 : Block(v.col))) return false;
  if ((v.row_opts & k2d) && s.M % 16) return false;
  if ((v.col_opts & k2d) && s.K % 16) return false;
  return true;
}

Out Alloc(int kind, int opts, bool col, bool swizzled, bool exact, const Shape& s) {
  Out o;
  if (kind == kNone) return o;
  const int64_t n = s.P * s.M * s.K;
  o.data_bytes = exact ? 2 * n : (kind == kNvfp4 ? n / 2 : n);
  const int64_t rows = s.P * (col ? s.K : s.M), blocked = col ? s.M : s.K, cols = blocked / Block(kind);
  o.scale_bytes = rows * cols;
  if (swizzled) {
    o.cols_padded = RoundUp(cols, 4);
    o.scale_bytes = RoundUp(rows, 128) * o.cols_padded;
  }
  if (opts & k1x64) o.wamax_bytes = rows * (blocked / 64) * 4;
  CK(cudaMalloc(&o.data, o.data_bytes));
  CK(cudaMalloc(&o.scale, o.scale_bytes));
  if (o.wamax_bytes) CK(cudaMalloc(reinterpret_cast<void**>(&o.wamax), o.wamax_bytes));
  return o;
}

void Free(Out& o) {
  cudaFree(o.data);
  cudaFree(o.scale);
  cudaFree(o.wamax);
}

struct Run {
  Out row, col;
  float* dbias = nullptr;
  size_t dbias_bytes = 0;
  Args a{};
};

Run Setup(const Variant& v, const Shape& s, const void* x, const float* amax, const uint32_t* key) {
  Run r;
  r.row = Alloc(v.row, v.row_opts, false, v.swizzled, v.row_exact, s);
  r.col = Alloc(v.col, v.col_opts, true, v.swizzled, v.col_exact, s);
  if (v.dbias) {
    r.dbias_bytes = s.P * ((s.M + 63) / 64) * s.K * 4;
    CK(cudaMalloc(reinterpret_cast<void**>(&r.dbias), r.dbias_bytes));
  }
  Args& a = r.a;
  a.x = x;
  a.P = s.P, a.M = s.M, a.K = s.K;
  a.amax_row = amax, a.amax_col = amax + s.P;
  a.key_row = key, a.key_col = key + 2;
  a.row_data = r.row.data, a.row_scale = r.row.scale, a.row_wamax = r.row.wamax;
  a.col_data = r.col.data, a.col_scale = r.col.scale, a.col_wamax = r.col.wamax;
  a.dbias = r.dbias;
  a.row_opts = v.row_opts, a.col_opts = v.col_opts;
  a.swizzled = v.swizzled;
  a.row_exact = v.row_exact, a.col_exact = v.col_exact;
  a.vector_loads = (s.K * 2) % 16 == 0;
  a.row_scale_cols_padded = r.row.cols_padded, a.col_scale_cols_padded = r.col.cols_padded;
  return r;
}

void Poison(Run& r, int byte) {
  for (Out* o : {&r.row, &r.col}) {
    if (o->data) CK(cudaMemset(o->data, byte, o->data_bytes));
    if (o->scale) CK(cudaMemset(o->scale, o->cols_padded ? 0 : byte, o->scale_bytes));
    if (o->wamax) CK(cudaMemset(o->wamax, byte, o->wamax_bytes));
  }
  if (r.dbias) CK(cudaMemset(r.dbias, byte, r.dbias_bytes));
}

std::vector<std::vector<uint8_t>> Fetch(const Run& r) {
  std::vector<std::vector<uint8_t>> out;
  auto get = [&](const void* p, size_t n) {
    std::vector<uint8_t> h(n);
    if (n) CK(cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost));
    out.push_back(std::move(h));
  };
  get(r.row.data, r.row.data_bytes), get(r.row.scale, r.row.scale_bytes), get(r.row.wamax, r.row.wamax_bytes);
  get(r.col.data, r.col.data_bytes), get(r.col.scale, r.col.scale_bytes), get(r.col.wamax, r.col.wamax_bytes);
  get(r.dbias, r.dbias_bytes);
  return out;
}

using LaunchFn = cudaError_t (*)(Args, cudaStream_t);

LaunchFn Pick(int row, int col) {
  using B = __nv_bfloat16;
#define JF4_CASE(R, C) \
  if (row == R && col == C) return &Launch<B, R, C>;
  JF4_CASE(kNvfp4, kNone) JF4_CASE(kNone, kNvfp4) JF4_CASE(kNvfp4, kNvfp4) JF4_CASE(kMxfp8E4m3, kNone)
  JF4_CASE(kNone, kMxfp8E4m3) JF4_CASE(kMxfp8E4m3, kMxfp8E4m3) JF4_CASE(kNvfp4, kMxfp8E4m3)
  JF4_CASE(kMxfp8E5m2, kMxfp8E5m2)
#undef JF4_CASE
  std::fprintf(stderr, "no launcher for %d/%d\n", row, col);
  std::exit(1);
}

double Bytes(const Run& r, const Shape& s) {
  double b = double(s.P * s.M * s.K) * 2;
  for (const Out* o : {&r.row, &r.col}) b += o->data_bytes + o->scale_bytes + o->wamax_bytes;
  return b + r.dbias_bytes;
}

int main(int argc, char** argv) {
  const kernel_check::Cli cli = kernel_check::ParseCli(argc, argv, /*normal_ok=*/true);
  const std::string &mode = cli.mode, &dir = cli.dir, &only = cli.only;
  const bool check = cli.check;
  std::vector<Shape> shapes;
  if (check) {
    shapes = {{1, 256, 256}, {3, 96, 200}, {2, 208, 136}, {1, 320, 1000}, {1, 64, 8}, {1, 96, 100}, {1, 1024, 1024}};
  } else if (mode == "time") {
    shapes = {{1, 8192, 8192}, {1, 16384, 4096}, {1, 16384, 14336}};
  } else {
    shapes = {{1, 8192, 8192}};
  }
  int failures = 0;
  for (const Shape& s : shapes) {
    const int64_t n = s.P * s.M * s.K;
    const std::vector<uint16_t> h =
        cli.normal ? kernel_check::MakeBf16Normal(n, 1234 + n) : kernel_check::MakeBf16Input(n, 1234 + n);
    void* x;
    CK(cudaMalloc(&x, n * 2));
    CK(cudaMemcpy(x, h.data(), n * 2, cudaMemcpyHostToDevice));
    // Per-p tensor amaxes (finite values only; NaN ignored as in the amax pass): rows and columns share them.
    std::vector<float> amax(2 * s.P, 0.0f);
    for (int64_t p = 0; p < s.P; ++p) {
      float m = 0;
      for (int64_t i = p * s.M * s.K; i < (p + 1) * s.M * s.K; ++i) {
        uint32_t u = uint32_t(h[i]) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        if (f == f) m = std::fmax(m, std::fabs(f));
      }
      amax[p] = amax[s.P + p] = m;
    }
    float* d_amax;
    uint32_t* d_key;
    const uint32_t key[4] = {0x12345678u, 0x9abcdef0u, 0x0badf00du, 0xdeadbeefu};
    CK(cudaMalloc(reinterpret_cast<void**>(&d_amax), amax.size() * 4));
    CK(cudaMemcpy(d_amax, amax.data(), amax.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(reinterpret_cast<void**>(&d_key), 16));
    CK(cudaMemcpy(d_key, key, 16, cudaMemcpyHostToDevice));
    double copy_us = 0;
    if (!check) {
      copy_us = kernel_check::CopyUs(n * 2, x);
      std::printf("[%lldx%lldx%lld] copy %.1f us = %.2f TB/s (read + write)\n", (long long)s.P, (long long)s.M,
                  (long long)s.K, copy_us, 4.0 * n / copy_us / 1e6);
    }
    for (const Variant& v : kVariants) {
      if (!only.empty() && std::string(v.name).find(only) == std::string::npos) continue;
      if (!Applies(v, s)) continue;
      Run r = Setup(v, s, x, d_amax, d_key);
      const LaunchFn fn = Pick(v.row, v.col);
      if (check) {
        Poison(r, mode == "dump" ? 0xA5 : 0x5A);
        CK(fn(r.a, 0));
        CK(cudaDeviceSynchronize());
        const auto got = Fetch(r);
        char fname[512];
        std::snprintf(fname, sizeof(fname), "%s/%s_%lld_%lld_%lld.bin", dir.c_str(), v.name, (long long)s.P,
                      (long long)s.M, (long long)s.K);
        for (char* c = fname + dir.size() + 1; *c; ++c) {
          if (*c == ' ' || *c == '+') *c = '_';
        }
        if (mode == "dump") {
          FILE* f = std::fopen(fname, "wb");
          for (const auto& b : got) std::fwrite(b.data(), 1, b.size(), f);
          std::fclose(f);
          continue;
        }
        FILE* f = std::fopen(fname, "rb");
        if (!f) {
          std::printf("missing %s\n", fname);
          ++failures;
          continue;
        }
        const char* names[] = {"row data", "row scale", "row wamax", "col data", "col scale", "col wamax", "dbias"};
        const std::string shape =
            "[" + std::to_string(s.P) + "," + std::to_string(s.M) + "," + std::to_string(s.K) + "]";
        const int bad = kernel_check::CompareParts(f, got, names, std::string(v.name) + " " + shape);
        std::fclose(f);
        std::printf("%-30s [%lld,%lld,%lld] %s\n", v.name, (long long)s.P, (long long)s.M, (long long)s.K,
                    bad ? "DIFFERS" : "bit-exact");
        failures += bad != 0;
      } else if (mode == "time") {
        const double t = kernel_check::BestUs([&] { return fn(r.a, 0); }, 20);
        const double bytes = Bytes(r, s), ceil_bps = 4.0 * n / copy_us * 1e6;
        std::printf("  %-30s %8.1f us %7.0f GB/s %5.1f%% of copy\n", v.name, t, bytes / (t * 1e-6) / 1e9,
                    100 * bytes / (t * 1e-6) / ceil_bps);
      } else {
        CK(fn(r.a, 0));
        CK(cudaDeviceSynchronize());
      }
      Free(r.row);
      Free(r.col);
      cudaFree(r.dbias);
    }
    cudaFree(x);
    cudaFree(d_amax);
    cudaFree(d_key);
  }
  if (mode == "compare") std::printf("%s: %d variant/shape pairs differ\n", failures ? "FAIL" : "OK", failures);
  return failures ? 1 : 0;
}
