// Standalone A/B check and timing of the grouped (MoE) quantize kernel without JAX (a development tool for kernel
// work; the project's tests and benchmarks go through JAX).
//
// Build it twice, against the kernel headers of a known-good revision and of the working tree; `dump DIR` with the
// first writes every output of every variant on the check cases (bf16 input of random values over many binades plus
// NaN, +-inf, +-0, subnormals; outputs poisoned before each run; the per-group NVFP4 amaxes from the grouped amax
// kernel), `compare DIR` with the second checks every output byte against those files. The check cases cover the
// tile path (aligned groups), the generic path (misaligned groups and the ones after them), empty groups, groups
// past the buffer and the zero-filled tail. `time` times grouped::LaunchQuantize alone (amaxes computed once
// beforehand: the benchmark's kernel mode) against a device-to-device copy of x (CUDA events, back-to-back
// launches), on the shapes and group sizes of benchmarks/grouped.py (N = 8), 64 random groups and one group (the
// scheduling overhead against the single-tensor kernel); for NVFP4 also the per-group amax pass alone (" amax": the
// bytes it reads over its time, against the copy's read + write rate).
//
// Build: nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -ftz=false -Icpp -o gcheck \
//            tools/dev/kernel_check/grouped_check.cu
// Run:   ./gcheck dump|compare DIR [variant substring]  |  ./gcheck time [variant substring]
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

#include "grouped/grouped_amax.cuh"
#include "grouped/grouped_quantize.cuh"
#include "check_common.cuh"

using namespace jax_fp4;
using namespace jax_fp4::quantize;


struct Variant {
  const char* name;
  int row, col, row_opts, col_opts;
};

const Variant kVariants[] = {
    {"nvfp4 row", kNvfp4, kNone, 0, 0},
    {"nvfp4 row+col", kNvfp4, kNvfp4, 0, 0},
    {"mixed nvfp4 row + mxfp8 col", kNvfp4, kMxfp8E4m3, 0, 0},
    {"nvfp4 RHT col", kNone, kNvfp4, 0, kRht},
    {"nvfp4 SR row + SR RHT col", kNvfp4, kNvfp4, kSr, kSr | kRht},
    {"mxfp8 row", kMxfp8E4m3, kNone, 0, 0},
    {"mxfp8 row+col", kMxfp8E4m3, kMxfp8E4m3, 0, 0},
    {"e5m2 col", kNone, kMxfp8E5m2, 0, 0},
};

// One grouped buffer: `size` elements, group g of first[g] x last[g] elements.
struct Case {
  std::string name;
  int64_t size;
  std::vector<int32_t> first, last;
};

int Block(int kind) { return kind == kNvfp4 ? 16 : 32; }

// n sizes, multiples of `align`, summing to total (as benchmarks/grouped.py draws them: some may be 0).
std::vector<int32_t> Split(int64_t total, int n, int align, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<double> w(n);
  double s = 0;
  for (double& v : w) s += (v = u(g) < 0.1 ? 0.0 : u(g));
  std::vector<int32_t> out(n);
  int64_t left = total / align;
  for (int i = 0; i < n; ++i) {
    const int64_t k = i + 1 == n ? left : std::min<int64_t>(left, int64_t(w[i] / s * (total / align)));
    out[i] = int32_t(k * align);
    left -= k;
  }
  return out;
}

std::vector<Case> TimeCases() {
  const std::vector<int32_t> n8 = {2304, 800, 1536, 1920, 4288, 3360, 1440, 736};  // benchmarks/grouped.py, N = 8
  std::vector<Case> cs;
  for (int64_t k : {4096, 7168}) {
    cs.push_back({"16384x" + std::to_string(k) + " N=1", 16384 * k, {16384}, {int32_t(k)}});
    cs.push_back({"16384x" + std::to_string(k) + " N=8", 16384 * k, n8, std::vector<int32_t>(8, int32_t(k))});
    cs.push_back({"16384x" + std::to_string(k) + " N=64", 16384 * k, Split(16384, 64, 32, 7),
                  std::vector<int32_t>(64, int32_t(k))});
  }
  return cs;
}

std::vector<Case> CheckCases() {
  std::vector<Case> cs;
  cs.push_back({"aligned rows K=256", 2048 * 256, Split(2048, 9, 32, 1), std::vector<int32_t>(9, 256)});
  cs.push_back({"uneven rows K=96", 1200 * 96, {0, 17, 64, 33, 128, 5, 200, 0, 300}, std::vector<int32_t>(9, 96)});
  cs.push_back({"varying both", 64 * 1024, {64, 32, 17, 96, 0, 40}, {128, 48, 64, 40, 96, 64}});
  cs.push_back({"past the buffer", 100 * 128, {32, 64, 48}, {128, 128, 64}});
  cs.push_back({"big groups K=1024", 2000 * 1024, {256, 0, 704, 1000, 40}, std::vector<int32_t>(5, 1024)});
  return cs;
}

template <typename T>
T* DevCopy(const std::vector<T>& h) {
  T* d = nullptr;
  CK(cudaMalloc(reinterpret_cast<void**>(&d), std::max<size_t>(1, h.size()) * sizeof(T)));
  if (!h.empty()) CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// One orientation's outputs (sizes as the FFI handler checks them).
struct Out {
  uint8_t* data = nullptr;
  uint8_t* scale = nullptr;
  float* amax = nullptr;
  size_t data_bytes = 0, scale_bytes = 0, amax_bytes = 0;
};

Out Alloc(int kind, int64_t size, int n) {
  Out o;
  if (kind == kNone) return o;
  o.data_bytes = kind == kNvfp4 ? (size + 1) / 2 : size;
  o.scale_bytes = size / Block(kind);
  o.amax_bytes = kind == kNvfp4 ? 4 * n : 0;
  CK(cudaMalloc(&o.data, std::max<size_t>(o.data_bytes, 1)));
  CK(cudaMalloc(&o.scale, std::max<size_t>(o.scale_bytes, 1)));
  if (o.amax_bytes) CK(cudaMalloc(reinterpret_cast<void**>(&o.amax), o.amax_bytes));
  return o;
}

void Free(Out& o) {
  cudaFree(o.data);
  cudaFree(o.scale);
  cudaFree(o.amax);
}

using LaunchFn = cudaError_t (*)(const grouped::QuantArgs&, cudaStream_t);

LaunchFn Pick(int row, int col) {
  using B = __nv_bfloat16;
#define JF4_CASE(R, C) \
  if (row == R && col == C) return &grouped::LaunchQuantize<B, R, C>;
  JF4_CASE(kNvfp4, kNone) JF4_CASE(kNone, kNvfp4) JF4_CASE(kNvfp4, kNvfp4) JF4_CASE(kMxfp8E4m3, kNone)
  JF4_CASE(kMxfp8E4m3, kMxfp8E4m3) JF4_CASE(kNvfp4, kMxfp8E4m3) JF4_CASE(kNone, kMxfp8E5m2)
#undef JF4_CASE
  std::fprintf(stderr, "no launcher for %d/%d\n", row, col);
  std::exit(1);
}

// Compares the fetched outputs with DIR's file (compare) or writes it (dump); returns the number of differing parts.
int DumpOrCompare(const std::string& mode, const std::string& dir, const Variant& v, const Case& c,
                  const std::vector<std::vector<uint8_t>>& got) {
  std::string fname = dir + "/" + v.name + "_" + c.name + ".bin";
  for (size_t i = dir.size() + 1; i < fname.size(); ++i) {
    if (fname[i] == ' ' || fname[i] == '+' || fname[i] == '=') fname[i] = '_';
  }
  if (mode == "dump") {
    FILE* f = std::fopen(fname.c_str(), "wb");
    for (const auto& b : got) std::fwrite(b.data(), 1, b.size(), f);
    std::fclose(f);
    return 0;
  }
  FILE* f = std::fopen(fname.c_str(), "rb");
  if (!f) {
    std::printf("missing %s\n", fname.c_str());
    return 1;
  }
  const char* names[] = {"row data", "row scale", "row amax", "col data", "col scale", "col amax"};
  const int bad = kernel_check::CompareParts(f, got, names, std::string(v.name) + " [" + c.name + "]");
  std::fclose(f);
  std::printf("%-30s [%s] %s\n", v.name, c.name.c_str(), bad ? "DIFFERS" : "bit-exact");
  return bad;
}

int main(int argc, char** argv) {
  const kernel_check::Cli cli = kernel_check::ParseCli(argc, argv);
  const std::string &mode = cli.mode, &dir = cli.dir, &only = cli.only;
  const bool check = cli.check;
  int failures = 0;
  for (const Case& c : check ? CheckCases() : TimeCases()) {
    const int n = int(c.first.size());
    const std::vector<uint16_t> h = kernel_check::MakeBf16Input(c.size, 99 + c.size);
    const void* x = DevCopy(h);
    const int32_t* first = DevCopy(c.first);
    const int32_t* last = DevCopy(c.last);
    std::vector<uint32_t> keys(2 * n);
    for (int i = 0; i < 2 * n; ++i) keys[i] = 0x9E3779B9u * uint32_t(i + 1);
    const uint32_t* key = DevCopy(keys);
    float* amax = nullptr;
    CK(cudaMalloc(reinterpret_cast<void**>(&amax), 8 * n));
    int32_t* work = nullptr;  // the scheduling counter
    CK(cudaMalloc(reinterpret_cast<void**>(&work), sizeof(int32_t)));
    double copy_us = 0;
    if (!check) {
      copy_us = kernel_check::CopyUs(2 * c.size, x);
      std::printf("[%s] copy %.1f us = %.2f TB/s (read + write)\n", c.name.c_str(), copy_us,
                  4.0 * c.size / copy_us / 1e6);
    }
    for (const Variant& v : kVariants) {
      if (!only.empty() && std::string(v.name).find(only) == std::string::npos) continue;
      Out row = Alloc(v.row, c.size, n), col = Alloc(v.col, c.size, n);
      grouped::QuantArgs a{};
      a.x = x, a.size = c.size, a.n = n, a.first_dims = first, a.last_dims = last, a.key_row = key, a.key_col = key;
      a.amax_row = amax, a.amax_col = amax + n;
      a.row_data = row.data, a.row_scale = row.scale, a.row_amax = row.amax;
      a.col_data = col.data, a.col_scale = col.scale, a.col_amax = col.amax;
      a.row_opts = v.row_opts, a.col_opts = v.col_opts, a.work = work;
      if (v.row == kNvfp4 || v.col == kNvfp4) {  // per-group amaxes (as the benchmark's kernel mode: not timed)
        CK(cudaMemset(amax, 0, 8 * n));
        grouped::AmaxArgs am{};
        am.x = x, am.size = c.size, am.n = n, am.first_dims = first, am.last_dims = last;
        am.amax_bits = reinterpret_cast<uint32_t*>(amax);
        am.row = v.row == kNvfp4, am.col = v.col == kNvfp4;
        am.row_rht = am.row && (v.row_opts & kRht), am.col_rht = am.col && (v.col_opts & kRht);
        CK(grouped::LaunchAmax<__nv_bfloat16>(am, 0));
        if (!check) {  // the amax pass alone (zeroing included, as the handler does): bytes read over the time
          const double t = kernel_check::BestUs(
              [&] {
                const cudaError_t e = cudaMemsetAsync(amax, 0, 8 * n, 0);
                return e != cudaSuccess ? e : grouped::LaunchAmax<__nv_bfloat16>(am, 0);
              },
              20);
          const double ceil_bps = 4.0 * c.size / copy_us * 1e6;
          std::printf("  %-30s %8.1f us %7.0f GB/s %5.1f%% of copy\n", (std::string(v.name) + " amax").c_str(), t,
                      2.0 * c.size / (t * 1e-6) / 1e9, 100 * 2.0 * c.size / (t * 1e-6) / ceil_bps);
        }
      }
      const LaunchFn picked = Pick(v.row, v.col);
      auto fn = [&](const grouped::QuantArgs& qa, cudaStream_t s) {  // the counter starts at 0 (as the handler does)
        const cudaError_t e = cudaMemsetAsync(work, 0, sizeof(int32_t), s);
        return e != cudaSuccess ? e : picked(qa, s);
      };
      if (check) {
        for (Out* o : {&row, &col}) {
          const int poison = mode == "dump" ? 0xA5 : 0x5A;
          if (o->data) CK(cudaMemset(o->data, poison, o->data_bytes));
          if (o->scale) CK(cudaMemset(o->scale, poison, o->scale_bytes));
          if (o->amax) CK(cudaMemset(o->amax, poison, o->amax_bytes));
        }
        CK(fn(a, 0));
        CK(cudaDeviceSynchronize());
        std::vector<std::vector<uint8_t>> got;
        for (Out* o : {&row, &col}) {
          for (auto [p, bytes] : {std::pair<const void*, size_t>{o->data, o->data_bytes}, {o->scale, o->scale_bytes},
                                  {o->amax, o->amax_bytes}}) {
            std::vector<uint8_t> b(bytes);
            if (bytes) CK(cudaMemcpy(b.data(), p, bytes, cudaMemcpyDeviceToHost));
            got.push_back(std::move(b));
          }
        }
        failures += DumpOrCompare(mode, dir, v, c, got) != 0;
      } else {
        const double t = kernel_check::BestUs([&] { return fn(a, 0); }, 20);
        const double bytes = 2.0 * c.size + row.data_bytes + row.scale_bytes + col.data_bytes + col.scale_bytes;
        const double ceil_bps = 4.0 * c.size / copy_us * 1e6;
        std::printf("  %-30s %8.1f us %7.0f GB/s %5.1f%% of copy\n", v.name, t, bytes / (t * 1e-6) / 1e9,
                    100 * bytes / (t * 1e-6) / ceil_bps);
      }
      Free(row);
      Free(col);
    }
    cudaFree(const_cast<void*>(x));
    cudaFree(const_cast<int32_t*>(first));
    cudaFree(const_cast<int32_t*>(last));
    cudaFree(const_cast<uint32_t*>(key));
    cudaFree(amax);
    cudaFree(work);
  }
  if (mode == "compare") std::printf("%s: %d variant/case pairs differ\n", failures ? "FAIL" : "OK", failures);
  return failures ? 1 : 0;
}
