// CPU FFI handlers `jf4_quantize`, `jf4_amax` and `jf4_rht_amax` (registered for platform "cpu" by
// jax_fp4/_src/ffi.py): the operands, results, attributes and checks of the CUDA handlers
// (cpp/quantize/quantize_ffi.cu, cpp/amax/amax_ffi.cu, cpp/quantize/rht_amax_ffi.cu), computed on the host in
// parallel over bands of 16 rows (cpu/parallel.h), bit-exact to jax_fp4.reference (the dbias partial sums are fp32
// sums in row order).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/convert.cuh"
#include "common/errors.h"
#include "common/ffi_checks.h"
#include "common/ffi_codes.h"
#include "common/ffi_utils.h"
#include "cpu/parallel.h"
#include "cpu/quantize_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace cpu {
namespace {

constexpr int64_t kMinWork = 1 << 18;  // elements per extra thread (smaller calls stay on the caller's thread)
constexpr int kFlagSwizzled = codes::quantize::kSwizzled, kFlagDbias = codes::quantize::kDbias,
              kFlagRowExact = codes::quantize::kRowExact, kFlagColExact = codes::quantize::kColExact;
using checks::kShardKeyWords;
using checks::Shape;

// Validates one orientation's three results (common/ffi_checks.h) and fills `o`.
ffi::Error Setup(Orientation& o, int64_t P, int64_t M, int64_t K, ffi::AnyBuffer data, ffi::AnyBuffer scale,
                 ffi::AnyBuffer wamax) {
  checks::QuantizeResults res;
  JF4_RETURN_IF_ERROR(checks::CheckQuantizeOrientation(o.kind, o.opts, o.col, o.exact, o.swizzled, P, M, K, data,
                                                       scale, wamax, &res));
  if (o.kind == kNone) return ffi::Error::Success();
  o.P = P, o.R = o.col ? K : M, o.C = o.col ? M : K;
  o.cols_padded = res.cols_padded;
  o.data = res.data, o.scale = res.scale, o.wamax = res.wamax;
  if (o.swizzled && res.scale_count) std::memset(o.scale, 0, res.scale_count);  // the padding is part of the output
  return ffi::Error::Success();
}

struct Input {
  const uint8_t* x;
  int64_t P, M, K;
  int bytes;
  bool bf16;
};

// Rows [r0, r0 + rows) of V[p] (the orientation's view of x) widened to fp32 into buf[rows][C].
JF4_CPU_CLONES void LoadBand(const Input& in, bool col, int64_t p, int64_t r0, int rows, float* buf) {
  const int64_t M = in.M, K = in.K;
  if (!col) {
    for (int i = 0; i < rows; ++i) WidenRun(in.x + ((p * M + r0 + i) * K) * in.bytes, K, in.bytes, in.bf16, buf + i * K);
    return;
  }
  float tmp[kBand];
  for (int64_t m = 0; m < M; ++m) {
    WidenRun(in.x + ((p * M + m) * K + r0) * in.bytes, rows, in.bytes, in.bf16, tmp);
    for (int i = 0; i < rows; ++i) buf[i * M + m] = tmp[i];
  }
}

void RunOrientation(const Input& in, const Orientation& o) {
  if (o.kind == kNone) return;
  if (o.col && o.kind != kNvfp4) {  // MXFP8 columnwise: a unit is one 32-row stripe of x[p], in x's layout
    const int64_t stripes = in.M / 32;
    ParallelFor(in.P * stripes, in.P * in.M * in.K, kMinWork, [&](int64_t u) {
      const int64_t p = u / stripes, m0 = (u % stripes) * 32;
      std::vector<float> buf(size_t(32) * in.K);
      LoadBand(in, false, p, m0, 32, buf.data());
      EncodeMxfp8Stripe(o, p, m0, buf.data());
    });
    return;
  }
  const int64_t bands = (o.R + kBand - 1) / kBand;
  ParallelFor(o.P * bands, o.P * o.R * o.C, kMinWork, [&](int64_t u) {
    const int64_t p = u / bands, r0 = (u % bands) * kBand;
    const int rows = int(std::min<int64_t>(kBand, o.R - r0));
    std::vector<float> buf(size_t(rows) * o.C);
    LoadBand(in, o.col, p, r0, rows, buf.data());
    EncodeBand(o, p, r0, rows, buf.data());
  });
}

// dbias[p, t, k] = sum of x[p, m, k] over the 64-row stripe t, in row order.
void RunDbias(const Input& in, float* dbias) {
  const int64_t stripes = (in.M + 63) / 64, K = in.K;
  ParallelFor(in.P * stripes, in.P * in.M * K, kMinWork, [&](int64_t u) {
    const int64_t p = u / stripes, m0 = (u % stripes) * 64, m1 = std::min(in.M, m0 + 64);
    float* out = dbias + u * K;
    std::fill(out, out + K, 0.0f);
    std::vector<float> row(K);
    for (int64_t m = m0; m < m1; ++m) {
      WidenRun(in.x + ((p * in.M + m) * K) * in.bytes, K, in.bytes, in.bf16, row.data());
      for (int64_t k = 0; k < K; ++k) out[k] += row[k];
    }
  });
}

ffi::Error InputOf(const ffi::AnyBuffer& x, const char* what, Input* in) {
  const auto t = x.element_type();
  JF4_CHECK(t == ffi::DataType::BF16 || t == ffi::DataType::F16 || t == ffi::DataType::F32,
            std::string(what) + ": unsupported dtype " + DataTypeName(t) + " (expected bfloat16, float16 or float32)");
  in->x = static_cast<const uint8_t*>(x.untyped_data());
  in->bytes = t == ffi::DataType::F32 ? 4 : 2;
  in->bf16 = t == ffi::DataType::BF16;
  return ffi::Error::Success();
}

ffi::Error QuantizeImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax_row, ffi::Buffer<ffi::F32> amax_col,
                        ffi::Buffer<ffi::U32> key_row, ffi::Buffer<ffi::U32> key_col, ffi::RemainingArgs,
                        ffi::Result<ffi::AnyBuffer> row_data, ffi::Result<ffi::AnyBuffer> row_scale,
                        ffi::Result<ffi::AnyBuffer> row_wamax, ffi::Result<ffi::AnyBuffer> col_data,
                        ffi::Result<ffi::AnyBuffer> col_scale, ffi::Result<ffi::AnyBuffer> col_wamax,
                        ffi::Result<ffi::AnyBuffer> dbias, int32_t row_kind, int32_t col_kind, int32_t flags) {
  int64_t P = 0, M = 0, K = 0;
  JF4_RETURN_IF_ERROR(checks::CheckQuantizeOperands(x, ElementCount(amax_row), ElementCount(amax_col),
                                                    ElementCount(key_row), ElementCount(key_col), row_kind, col_kind,
                                                    flags, &P, &M, &K));
  Input in{};
  JF4_RETURN_IF_ERROR(InputOf(x, "jf4_quantize: x", &in));
  in.P = P, in.M = M, in.K = K;
  const bool swizzled = flags & kFlagSwizzled, with_dbias = flags & kFlagDbias;

  Orientation row, col;
  const int mask = codes::quantize::kOptionMask;
  row.kind = row_kind, row.opts = flags & mask, row.exact = flags & kFlagRowExact, row.swizzled = swizzled;
  col.kind = col_kind, col.opts = (flags >> codes::quantize::kColShift) & mask, col.exact = flags & kFlagColExact,
  col.swizzled = swizzled;
  col.col = true;
  row.amax = amax_row.typed_data(), col.amax = amax_col.typed_data();
  row.key = key_row.typed_data(), col.key = key_col.typed_data();
  row.stream = ElementCount(key_row) == kShardKeyWords ? row.key + 2 : nullptr;
  col.stream = ElementCount(key_col) == kShardKeyWords ? col.key + 2 : nullptr;
  JF4_RETURN_IF_ERROR(Setup(row, P, M, K, *row_data, *row_scale, *row_wamax));
  JF4_RETURN_IF_ERROR(Setup(col, P, M, K, *col_data, *col_scale, *col_wamax));
  JF4_RETURN_IF_ERROR(checks::CheckDbias(*dbias, flags, P, M, K));
  if (P * M * K == 0) return ffi::Error::Success();
  JF4_CHECK(in.x != nullptr, "jf4_quantize: null input buffer");
  RunOrientation(in, row);
  RunOrientation(in, col);
  if (with_dbias) RunDbias(in, static_cast<float*>(dbias->untyped_data()));
  return ffi::Error::Success();
}

// |x| as fp32 bits with NaN -> 0 (non-negative floats order like their bits): reference/amax.py abs_bits. As a
// signed int (the keys are below 2^31), so max loops vectorise without an unsigned max instruction.
JF4_CPU_INLINE int32_t AbsBits(float v) {
  const uint32_t a = cvt::Bits(v) & 0x7FFFFFFFu;
  return a > 0x7F800000u ? 0 : int32_t(a);
}

}  // namespace

// max of AbsBits over n input elements of dtype `bytes` / `bf16` (Input); quantize_cpu.h.
JF4_CPU_CLONES int32_t AbsBitsMax(const uint8_t* x, int64_t n, int bytes, bool bf16) {
  float v[256];
  int32_t m = 0;
  for (int64_t i = 0; i < n; i += 256) {
    const int64_t len = std::min<int64_t>(256, n - i);
    WidenRun(x + i * bytes, len, bytes, bf16, v);
    for (int64_t k = 0; k < len; ++k) m = std::max(m, AbsBits(v[k]));
  }
  return m;
}

namespace {

ffi::Error AmaxImpl(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  JF4_CHECK(ElementCount(*out) == 1,
            "jf4_amax: output must hold one float32, got " + std::to_string(ElementCount(*out)) + " elements");
  Input in{};
  JF4_RETURN_IF_ERROR(InputOf(x, "jf4_amax: x", &in));
  const int64_t n = static_cast<int64_t>(ElementCount(x));
  JF4_CHECK(n == 0 || in.x != nullptr, "jf4_amax: null input buffer");
  constexpr int64_t kChunk = 1 << 14;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<uint32_t> part(chunks, 0u);
  ParallelFor(chunks, n, kMinWork, [&](int64_t u) {
    const int64_t b = u * kChunk, e = std::min(n, b + kChunk);
    part[u] = uint32_t(AbsBitsMax(in.x + b * in.bytes, e - b, in.bytes, in.bf16));
  });
  uint32_t m = 0;
  for (uint32_t v : part) m = std::max(m, v);
  out->typed_data()[0] = cvt::Float(m);
  return ffi::Error::Success();
}

// out[p] = max |RHT(V[p])| over 16-chunks along K (col = 0) or M (col = 1), bf16-rounded as quantize sees it.
ffi::Error RhtAmaxImpl(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::F32>> out, int32_t col) {
  const auto dims = x.dimensions();
  JF4_CHECK(dims.size() == 3, "jf4_rht_amax: x must be rank 3 [P, M, K], got rank " + std::to_string(dims.size()));
  Input in{};
  JF4_RETURN_IF_ERROR(InputOf(x, "jf4_rht_amax: x", &in));
  in.P = dims[0], in.M = dims[1], in.K = dims[2];
  const int64_t R = col ? in.K : in.M, C = col ? in.M : in.K;
  JF4_CHECK(C % 16 == 0, "jf4_rht_amax: the transformed axis of x " + Shape(in.P, in.M, in.K) + " is not % 16");
  JF4_CHECK(static_cast<int64_t>(ElementCount(*out)) == in.P,
            "jf4_rht_amax: output must hold P = " + std::to_string(in.P) + " floats");
  const int64_t bands = (R + kBand - 1) / kBand;
  std::vector<uint32_t> part(in.P * bands, 0u);
  if (in.P * R * C != 0) {
    JF4_CHECK(in.x != nullptr, "jf4_rht_amax: null input buffer");
    ParallelFor(in.P * bands, in.P * R * C, kMinWork, [&](int64_t u) {
      const int64_t p = u / bands, r0 = (u % bands) * kBand;
      const int rows = int(std::min<int64_t>(kBand, R - r0));
      std::vector<float> buf(size_t(rows) * C);
      LoadBand(in, col != 0, p, r0, rows, buf.data());
      int32_t m = 0;
      for (int64_t c = 0; c < int64_t(rows) * C; c += 16) {
        float (&v)[16] = *reinterpret_cast<float(*)[16]>(buf.data() + c);
        cvt::RhtForward16(v);
        for (int i = 0; i < 16; ++i) m = std::max(m, AbsBits(v[i]));
      }
      part[u] = uint32_t(m);
    });
  }
  for (int64_t p = 0; p < in.P; ++p) {
    uint32_t m = 0;
    for (int64_t b = 0; b < bands; ++b) m = std::max(m, part[p * bands + b]);
    out->typed_data()[p] = cvt::Float(m);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cpu
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(jf4_cpu_quantize, jax_fp4::cpu::QuantizeImpl,
                              jax_fp4::checks::QuantizeSignature(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jf4_cpu_amax, jax_fp4::cpu::AmaxImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jf4_cpu_rht_amax, jax_fp4::cpu::RhtAmaxImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int32_t>("col"));
