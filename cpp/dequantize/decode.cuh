// Element decoders shared by the dequantize kernels and the quantize kernels' exact-operand output (docs/numerics.md
// sections 1-3): E2M1 / E4M3 / E5M2 codes and E8M0 scales to exact fp32, and fp32 to the output dtypes' bits with
// the reference's rounding (RNE) and canonical NaN.
#pragma once

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#endif

#include <cstdint>
#include <type_traits>

#include "common/convert.cuh"
#include "common/ffi_codes.h"
#include "common/hd.h"

namespace jax_fp4 {
namespace dequantize {

using codes::Kind;
using codes::kMxfp8E4m3;
using codes::kMxfp8E5m2;
using codes::kNvfp4;

// E2M1 code -> value, built on the fp32 bits (no table: a dynamically indexed array would live in local memory).
// Exponent field e = code bits 1..2, mantissa m = bit 0: e == 0 gives 0 or 0.5; else (1 + m/2) * 2^(e-1). Code 8 = -0.
JF4_HD float E2M1Value(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const uint32_t mag = e ? (((e + 126u) << 23) | (m << 22)) : (m ? 0x3F000000u : 0u);
  return cvt::Float(mag | ((code & 8u) << 28));
}

#if defined(__CUDACC__)  // the packed decoders below are device-only (byte permutes, half2)

// Exact fp32 values of the first kN (4 or 8) E2M1 codes packed in `word` (code i in bits 4i..4i+3). Two byte
// permutes look up the upper 16 bits of each magnitude's fp32 pattern (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6:
// 0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0; byte 3 and byte 2 tables), a third interleaves
// two elements' halves, and the sign moves from bit 3 of the nibble to bit 31. Same values as E2M1Value, ~3
// instructions per element instead of ~9.
template <int kN>
__device__ __forceinline__ void E2M1xN(uint32_t word, float (&q)[kN]) {
  static_assert(kN == 4 || kN == 8, "E2M1xN decodes 4 or 8 codes");
  constexpr uint32_t kByte3Lo = 0x3F3F3F00u, kByte3Hi = 0x40404040u;  // magnitudes 0..3, 4..7
  constexpr uint32_t kByte2Lo = 0xC0800000u, kByte2Hi = 0xC0804000u;
#pragma unroll
  for (int h = 0; h < kN / 4; ++h) {
    const uint32_t sel = (word >> (16 * h)) & 0x7777u;
    const uint32_t b3 = __byte_perm(kByte3Lo, kByte3Hi, sel), b2 = __byte_perm(kByte2Lo, kByte2Hi, sel);
    const uint32_t x01 = __byte_perm(b2, b3, 0x5140u), x23 = __byte_perm(b2, b3, 0x7362u);
    const uint32_t hi[4] = {x01 << 16, x01 & 0xFFFF0000u, x23 << 16, x23 & 0xFFFF0000u};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int k = 4 * h + i;
      q[k] = __uint_as_float(hi[i] | ((word << (28 - 4 * k)) & 0x80000000u));
    }
  }
}

// The values q * 2^-14 of the 8 E2M1 codes packed in `word` (code i in bits 4i..4i+3), exact, through fp16: the
// magnitude bits (e1 e0 m) placed at fp16 bits 11..9 are the fp16 number q * 2^-14 (e == 0: the subnormal 0 or
// 2^-15; else (1 + m/2) * 2^(e-15)), the sign goes to bit 15, and codes k and k + 4 share one half2 word (one shift
// serves both lanes), each lane widened by one fp16 -> fp32 conversion. About 3 instructions per element against
// E2M1xN's 4; callers fold the 2^14 into their multiplier (exact when it stays finite).
__device__ __forceinline__ void E2M1x8Half(uint32_t word, float (&q)[8]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t mag = k < 3 ? (word & (0x00070007u << (4 * k))) << (9 - 4 * k) : (word >> 3) & 0x0E000E00u;
    const uint32_t bits = mag | ((word << (12 - 4 * k)) & 0x80008000u);
    const __half2 h = *reinterpret_cast<const __half2*>(&bits);
    q[k] = __low2float(h);
    q[k + 4] = __high2float(h);
  }
}

#endif  // __CUDACC__

// Exact float of an E4M3 / E5M2 code (NaN codes give NaN, E5M2 infinities give infinities).
template <int kKind>
JF4_HD float Fp8Value(uint32_t code) {
#if defined(__CUDA_ARCH__)
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code),
                                               kKind == kMxfp8E4m3 ? __NV_E4M3 : __NV_E5M2);
  return __half2float(__half(h));
#else
  const uint32_t mag = code & 0x7Fu, sign = (code & 0x80u) << 24;
  if (kKind == kMxfp8E4m3) {
    if (mag == 0x7Fu) return cvt::Float(sign | 0x7FC00000u);
    return cvt::SmallFloatValue<3, 7>(code);
  }
  if (mag > 0x7Cu) return cvt::Float(sign | 0x7FC00000u);
  if (mag == 0x7Cu) return cvt::Float(sign | 0x7F800000u);
  return cvt::SmallFloatValue<2, 15>(code);
#endif
}

// E8M0 code -> 2^(e-127): code 0 is the fp32 subnormal 2^-127, 255 is NaN.
JF4_HD float E8M0Value(uint32_t e) {
  if (e == 255u) return cvt::Float(0x7FC00000u);
  if (e == 0u) return cvt::Float(0x00400000u);
  return cvt::Float(e << 23);
}

// fp32 bits of the largest finite value of each output dtype: float32 FLT_MAX, bfloat16 0x7F7F, float16 65504.
constexpr uint32_t kF32MaxBits = 0x7F7FFFFFu, kBf16MaxBits = 0x7F7F0000u, kF16MaxBits = 0x477FE000u;

// MXFP8 element decode (docs/numerics.md section 2, Dequantize; reference mxfp8.dequantize): v = float(q) * s with
// s = 2^(e-127) (E8M0Value). Where |v| exceeds M, the output dtype's largest finite value (bits `max_bits`; the fp32
// overflow to inf included), and the code's rounding interval reaches into the output's range -- the midpoint
// between |q| and the next smaller magnitude, times s, is <= M -- the result is +-M: the E8M0 scale rounds up, so a
// value at the top of the range can take a code past it (bf16 max -> E4M3 256 * 2^120 = 2^128; lower midpoint
// 248 * 2^120 <= bf16 max), and converting +-M to the output gives M. A code whose whole interval lies beyond M
// decodes as TE's (+-inf in the output): a genuine overflow, e.g. the encoding of +-inf (scale 0xFE, code
// max_norm: 432 * 2^127 overflows) or an f32 tensor decoded to f16. NaN stays NaN, an E5M2 infinity infinite.
// MxSaturate: the rule applied to an already formed product v = float(q) * s.
template <int kKind>
JF4_HD float MxSaturate(float v, uint32_t code, float s, uint32_t max_bits) {
  const uint32_t b = cvt::Bits(v), mag = b & 0x7FFFFFFFu;
  const uint32_t c = code & 0x7Fu;  // > 0 whenever mag > max_bits
  if (mag <= max_bits || mag > 0x7F800000u || (kKind == kMxfp8E5m2 && c == 0x7Cu)) return v;
  const float mid = cvt::Mul(Fp8Value<kKind>(c) + Fp8Value<kKind>(c - 1u), 0.5f);  // exact
  return cvt::Float(cvt::Bits(cvt::Mul(mid, s)) <= max_bits ? (b & 0x80000000u) | max_bits : b);
}
template <int kKind>
JF4_HD float MxDecode(uint32_t code, float s, uint32_t max_bits) {
  return MxSaturate<kKind>(cvt::Mul(Fp8Value<kKind>(code), s), code, s, max_bits);
}

#if defined(__CUDACC__)  // output packing of the kernels (device types)

// kF32MaxBits / kBf16MaxBits / kF16MaxBits of an output type.
template <typename Out>
__device__ __forceinline__ constexpr uint32_t OutMaxBits() {
  return sizeof(Out) == 4 ? kF32MaxBits : (std::is_same<Out, __half>::value ? kF16MaxBits : kBf16MaxBits);
}

// fp32 -> output bits, RNE, canonical NaN (0x7FC00000 / 0x7FC0 / 0x7E00) as the reference writes it.
template <typename Out>
__device__ __forceinline__ uint32_t OutBits(float v);
template <>
__device__ __forceinline__ uint32_t OutBits<float>(float v) { return v != v ? 0x7FC00000u : __float_as_uint(v); }
template <>
__device__ __forceinline__ uint32_t OutBits<__nv_bfloat16>(float v) {
  return v != v ? 0x7FC0u : uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(v)));
}
template <>
__device__ __forceinline__ uint32_t OutBits<__half>(float v) {
  return v != v ? 0x7E00u : uint32_t(__half_as_ushort(__float2half_rn(v)));
}

// Packs out-dtype bits of v[0..16/sizeof(Out)) into one 16-byte vector.
template <typename Out, int kV>
__device__ __forceinline__ uint4 PackRun(const float (&v)[kV]) {
  if constexpr (sizeof(Out) == 4) {
    return make_uint4(OutBits<Out>(v[0]), OutBits<Out>(v[1]), OutBits<Out>(v[2]), OutBits<Out>(v[3]));
  } else {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = OutBits<Out>(v[2 * i]) | (OutBits<Out>(v[2 * i + 1]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// PackRun for values known not to be NaN: paired conversions (cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32), same bits.
template <typename Out, int kV>
__device__ __forceinline__ uint4 PackRunFinite(const float (&v)[kV]) {
  if constexpr (sizeof(Out) == 4) {
    return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
  } else {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (std::is_same<Out, __half>::value) {
        const __half2 h = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
        w[i] = *reinterpret_cast<const uint32_t*>(&h);
      } else {
        const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
        w[i] = *reinterpret_cast<const uint32_t*>(&h);
      }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

#endif  // __CUDACC__

}  // namespace dequantize
}  // namespace jax_fp4
