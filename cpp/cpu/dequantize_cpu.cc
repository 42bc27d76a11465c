// CPU FFI handlers `jf4_dequantize`, `jf4_swizzle` and `jf4_unswizzle`: the operands, results, attributes and checks
// of the CUDA handlers (cpp/dequantize/dequantize_ffi.cu, cpp/swizzle/swizzle_ffi.cu), computed on the host in
// parallel over rows, bit-exact to jax_fp4.reference (docs/numerics.md sections 1-3) with the kernels' decoders
// (dequantize/decode.cuh, common/convert.cuh compiled for the host).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/convert.cuh"
#include "common/errors.h"
#include "common/ffi_checks.h"
#include "common/ffi_codes.h"
#include "common/ffi_utils.h"
#include "common/scale_layout.cuh"
#include "cpu/dequantize_cpu.h"
#include "cpu/parallel.h"
#include "dequantize/decode.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace cpu {
namespace {

// jf4_dequantize flags (common/ffi_codes.h).
constexpr int kRhtFlag = codes::dequantize::kRht, k1x64Flag = codes::dequantize::kLocal1x64,
              kSwizzledFlag = codes::dequantize::kSwizzled, kTransposeOut = codes::dequantize::kTransposeOut,
              kMxColumnwise = codes::dequantize::kMxColumnwise;
constexpr int64_t kMinWork = 1 << 18;  // elements per extra thread

}  // namespace

// float16 bits of v, RNE with gradual underflow, overflow to inf, NaN -> 0x7E00 (the reference's canonical NaN).
// Below 2^-14 the code is rint(|v| * 2^24) (multiples of 2^-24; may round up to 0x400): an exact scaling, rounded
// once to nearest even by the sum with 2^23 (cvt::SmallFloatRne's form; both ranges computed, one selected).
static JF4_CPU_INLINE uint32_t F16Rne(float v) {
  const uint32_t b = cvt::Bits(v), mag = b & 0x7FFFFFFFu, sign = (b >> 16) & 0x8000u;
  const uint32_t sub = cvt::Bits(cvt::Float(mag) * 16777216.0f + 8388608.0f) - 0x4B000000u;
  const uint32_t normal = ((mag + 0xFFFu + ((mag >> 13) & 1u)) >> 13) - (112u << 10);
  const uint32_t code = mag < 0x38800000u ? sub : (normal > 0x7C00u ? 0x7C00u : normal);
  return mag > 0x7F800000u ? 0x7E00u : (sign | code);
}

// The output element of fp32 v: float32 with canonical NaN, bfloat16 / float16 RNE with canonical NaN.
void Store(void* out, int bytes, bool bf16, int64_t i, float v) {
  if (bytes == 4) {
    const uint32_t b = v != v ? 0x7FC00000u : cvt::Bits(v);
    std::memcpy(static_cast<uint8_t*>(out) + 4 * i, &b, 4);
  } else {
    const uint16_t b = uint16_t(bf16 ? cvt::Bf16Rne(v) : F16Rne(v));
    std::memcpy(static_cast<uint8_t*>(out) + 2 * i, &b, 2);
  }
}

// Store of n consecutive output elements from element i on (one loop per output dtype, so each vectorises).
JF4_CPU_CLONES static void StoreRun(void* out, int bytes, bool bf16, int64_t i, const float* v, int64_t n) {
  if (bytes == 4) {
    uint32_t* o = static_cast<uint32_t*>(out) + i;
    for (int64_t k = 0; k < n; ++k) o[k] = v[k] != v[k] ? 0x7FC00000u : cvt::Bits(v[k]);
  } else if (bf16) {
    uint16_t* o = static_cast<uint16_t*>(out) + i;
    for (int64_t k = 0; k < n; ++k) o[k] = uint16_t(cvt::Bf16Rne(v[k]));
  } else {
    uint16_t* o = static_cast<uint16_t*>(out) + i;
    for (int64_t k = 0; k < n; ++k) o[k] = uint16_t(F16Rne(v[k]));
  }
}

// v[k] = dequantize::MxDecode(d[k], s[k], max_bits) for n MXFP8 codes (s: per element scales; max_bits: the
// output dtype's largest finite value, MxValue).
template <int kKind>
static JF4_CPU_INLINE void DecodeMx(const uint8_t* d, const float* s, int64_t n, uint32_t max_bits, float* v) {
  for (int64_t k = 0; k < n; ++k) v[k] = dequantize::MxDecode<kKind>(d[k], s[k], max_bits);
}
JF4_CPU_CLONES static void DecodeMxRun(const Geometry& g, const uint8_t* d, const float* s, int64_t n, float* v) {
  const uint32_t max_bits = g.out_bytes == 4 ? dequantize::kF32MaxBits
                                             : (g.out_bf16 ? dequantize::kBf16MaxBits : dequantize::kF16MaxBits);
  if (g.kind == dequantize::kMxfp8E4m3) DecodeMx<dequantize::kMxfp8E4m3>(d, s, n, max_bits, v);
  else DecodeMx<dequantize::kMxfp8E5m2>(d, s, n, max_bits, v);
}

// Inverse RHT of one 16-chunk (reference/rht.py inverse): flush, butterfly (flushed), * 0.25 (flushed), signs.
void RhtInverse16(float (&v)[16]) {
  cvt::RhtButterfly16(v);
  for (int i = 0; i < 16; ++i) {
    const float y = cvt::Flush(cvt::Mul(v[i], 0.25f));
    v[i] = ((cvt::kRhtSignMask >> i) & 1u) ? -y : y;
  }
}

static int64_t ScaleIdx(const Geometry& g, int64_t row, int64_t j, int64_t cols) {
  return (g.flags & kSwizzledFlag) ? layout::SwizzledIndex(row, j, g.cols_padded) : row * cols + j;
}

float MxValue(int kind, int out_bytes, bool out_bf16, uint32_t code, float s) {
  const uint32_t max_bits = out_bytes == 4 ? dequantize::kF32MaxBits
                                           : (out_bf16 ? dequantize::kBf16MaxBits : dequantize::kF16MaxBits);
  return kind == dequantize::kMxfp8E4m3 ? dequantize::MxDecode<dequantize::kMxfp8E4m3>(code, s, max_bits)
                                        : dequantize::MxDecode<dequantize::kMxfp8E5m2>(code, s, max_bits);
}

// Row r of data[p]: NVFP4, or MXFP8 rowwise (blocks along C).
void DequantizeRow(const Geometry& g, int64_t p, int64_t r, float* v) {
  const int64_t C = g.C, row = p * g.R + r;
  if (g.kind == dequantize::kNvfp4) {
    const int64_t nb = C / 16;
    const bool local = g.flags & k1x64Flag;
    const float a = g.amax ? g.amax[g.amax_per_p ? p : 0] : 0.0f;
    for (int64_t j = 0; j < nb; ++j) {
      const float s_b = cvt::E4M3Value(g.scale[ScaleIdx(g, row, j, nb)]);
      const uint8_t* d = g.data + (row * C + 16 * j) / 2;
      float f = s_b, enc = 1.0f;
      if (local) enc = cvt::WindowEncodeScale(g.wamax[row * (C / 64) + j / 4]);
      else if (g.amax) f = cvt::Nvfp4DecodeScale(s_b, a, g.flags & codes::dequantize::kE4m3Max256);
      for (int i = 0; i < 16; ++i) {
        const float q = dequantize::E2M1Value((d[i >> 1] >> (4 * (i & 1))) & 0xFu);
        v[16 * j + i] = local ? cvt::Div(cvt::Mul(q, s_b), enc) : cvt::Mul(q, f);
      }
      if (g.flags & kRhtFlag) RhtInverse16(*reinterpret_cast<float(*)[16]>(v + 16 * j));
    }
    return;
  }
  const int64_t nb = C / 32;
  float s[32];
  for (int64_t j = 0; j < nb; ++j) {
    std::fill(s, s + 32, dequantize::E8M0Value(g.scale[ScaleIdx(g, row, j, nb)]));
    DecodeMxRun(g, g.data + row * C + 32 * j, s, 32, v + 32 * j);
  }
}

int64_t DequantizeUnits(const Geometry& g) {
  return (g.flags & kMxColumnwise) ? g.P * (g.R / 32) : g.P * g.R;
}

void DequantizeUnit(const Geometry& g, int64_t u) {
  if (g.flags & kMxColumnwise) {  // MXFP8 blocks along R: a unit is one 32-row block of data[p], decoded row by row
    const int64_t nbr = g.R / 32;
    const int64_t p = u / nbr, jb = u % nbr;
    std::vector<float> s(g.C), v(g.C);
    for (int64_t c = 0; c < g.C; ++c) {
      const int64_t idx = (g.flags & kSwizzledFlag) ? layout::SwizzledIndex(p * g.C + c, jb, g.cols_padded)
                                                     : (p * nbr + jb) * g.C + c;
      s[c] = dequantize::E8M0Value(g.scale[idx]);
    }
    for (int64_t i = 0; i < 32; ++i) {
      const int64_t row = p * g.R + 32 * jb + i;
      DecodeMxRun(g, g.data + row * g.C, s.data(), g.C, v.data());
      StoreRun(g.out, g.out_bytes, g.out_bf16, row * g.C, v.data(), g.C);
    }
    return;
  }
  const int64_t p = u / g.R, r = u % g.R;
  std::vector<float> v(g.C);
  DequantizeRow(g, p, r, v.data());
  if (!(g.flags & kTransposeOut)) {
    StoreRun(g.out, g.out_bytes, g.out_bf16, u * g.C, v.data(), g.C);
    return;
  }
  for (int64_t c = 0; c < g.C; ++c) Store(g.out, g.out_bytes, g.out_bf16, (p * g.C + c) * g.R + r, v[c]);
}

namespace {

void Run(const Geometry& g) {
  ParallelFor(DequantizeUnits(g), g.P * g.R * g.C, kMinWork, [&](int64_t u) { DequantizeUnit(g, u); });
}

ffi::Error DequantizeImpl(ffi::AnyBuffer data, ffi::AnyBuffer scale, ffi::Buffer<ffi::F32> amax,
                          ffi::Buffer<ffi::F32> window_amax, ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> out,
                          int32_t kind, int32_t flags) {
  checks::DequantizeGeometry dg;
  JF4_RETURN_IF_ERROR(checks::CheckDequantize(data, scale, ElementCount(amax), ElementCount(window_amax), *out, kind,
                                              flags, &dg));
  if (dg.P * dg.R * dg.C == 0) return ffi::Error::Success();
  Geometry g{};
  g.data = static_cast<const uint8_t*>(data.untyped_data());
  g.scale = static_cast<const uint8_t*>(scale.untyped_data());
  g.amax = dg.tensor_scale ? amax.typed_data() : nullptr;
  g.amax_per_p = dg.amax_per_p;
  g.wamax = dg.local ? window_amax.typed_data() : nullptr;
  g.P = dg.P, g.R = dg.R, g.C = dg.C, g.cols_padded = dg.cols_padded;
  g.kind = kind, g.flags = flags;
  g.out = out->untyped_data();
  const auto ot = out->element_type();
  g.out_bytes = ot == ffi::DataType::F32 ? 4 : 2;
  g.out_bf16 = ot == ffi::DataType::BF16;
  JF4_CHECK(g.data != nullptr && g.scale != nullptr && g.out != nullptr, dg.where + ": null buffer");
  Run(g);
  return ffi::Error::Success();
}

// ---- swizzle / unswizzle ------------------------------------------------------------------------------------------
bool ByteType(ffi::DataType t) {
  return t == ffi::DataType::U8 || t == ffi::DataType::S8 || t == ffi::DataType::F8E4M3FN ||
         t == ffi::DataType::F8E5M2 || t == ffi::DataType::F8E8M0FNU;
}

template <bool kSwizzle>
ffi::Error LayoutImpl(ffi::AnyBuffer in, ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> out) {
  const char* name = kSwizzle ? "jf4_swizzle" : "jf4_unswizzle";
  const ffi::AnyBuffer& compact = kSwizzle ? in : *out;
  const ffi::AnyBuffer& swizzled = kSwizzle ? *out : in;
  const auto cd = compact.dimensions(), sd = swizzled.dimensions();
  const std::string where = name;
  JF4_CHECK(ByteType(in.element_type()) && in.element_type() == out->element_type(),
            where + ": in and out must share one 8-bit dtype, got " + DataTypeName(in.element_type()) + " and " +
                DataTypeName(out->element_type()));
  JF4_CHECK(cd.size() >= 2 && cd.size() == sd.size(), where + ": matrices of rank >= 2 with equal ranks");
  int64_t batch = 1;
  for (size_t i = 0; i + 2 < cd.size(); ++i) {
    JF4_CHECK(cd[i] == sd[i], where + ": leading dimensions differ");
    batch *= cd[i];
  }
  const int64_t rows = cd[cd.size() - 2], cols = cd[cd.size() - 1];
  const int64_t rp = checks::RoundUp(rows, 128), cp = checks::RoundUp(cols, 4);
  JF4_CHECK(sd[sd.size() - 2] == rp && sd[sd.size() - 1] == cp,
            where + ": the swizzled matrix must be [round_up(rows, 128), round_up(cols, 4)] = [" +
                std::to_string(rp) + ", " + std::to_string(cp) + "]");
  if (batch * rp * cp == 0) return ffi::Error::Success();
  const auto* src = static_cast<const uint8_t*>(in.untyped_data());
  auto* dst = static_cast<uint8_t*>(out->untyped_data());
  JF4_CHECK(src != nullptr && dst != nullptr, where + ": null buffer");
  const int64_t tiles = rp / 128;
  ParallelFor(batch * tiles, batch * rp * cp, kMinWork, [&](int64_t u) {
    const int64_t b = u / tiles, i0 = (u % tiles) * 128;
    const uint8_t* s = src + b * (kSwizzle ? rows * cols : rp * cp);
    uint8_t* d = dst + b * (kSwizzle ? rp * cp : rows * cols);
    for (int64_t i = i0; i < i0 + 128; ++i) {
      for (int64_t j = 0; j < cp; ++j) {
        const int64_t z = layout::SwizzledIndex(i, j, cp);
        const bool inside = i < rows && j < cols;
        if (kSwizzle) d[z] = inside ? s[i * cols + j] : 0;  // the padding is zero bytes
        else if (inside) d[i * cols + j] = s[z];
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cpu
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(jf4_cpu_dequantize, jax_fp4::cpu::DequantizeImpl,
                              jax_fp4::checks::DequantizeSignature(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jf4_cpu_swizzle, jax_fp4::cpu::LayoutImpl<true>,
                              xla::ffi::Ffi::Bind().Arg<xla::ffi::AnyBuffer>().RemainingArgs().Ret<xla::ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jf4_cpu_unswizzle, jax_fp4::cpu::LayoutImpl<false>,
                              xla::ffi::Ffi::Bind().Arg<xla::ffi::AnyBuffer>().RemainingArgs().Ret<xla::ffi::AnyBuffer>());
