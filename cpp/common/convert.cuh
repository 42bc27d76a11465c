// Conversions and scale arithmetic of the numeric contract (docs/numerics.md), for the CUDA kernels and the CPU
// handlers (common/hd.h: device paths under __CUDA_ARCH__, a bit-identical portable path on the host).
//
// Every function here is bit-exact to jax_fp4.reference:
//  * fp32 products / quotients use the IEEE intrinsics (__fmul_rn, __frcp_rn, __fdiv_rn): no contraction into FMAs,
//    no flush-to-zero (the library is built with -ftz=false -prec-div=true); the host uses the plain operators
//    (-ffp-contract=off, subnormals kept);
//  * E4M3 / E5M2 use cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 (sm_89+, so Hopper runs them natively); the host rounds
//    on the bit pattern (SmallFloatRne);
//  * E2M1 encoding lives in e2m1.cuh.
#pragma once

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#endif

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "common/e2m1.cuh"
#include "common/hd.h"

namespace jax_fp4 {
namespace cvt {

using e2m1::Bits;
using e2m1::Float;

// fp32 constants by bit pattern (np.float32 of the exact quotient; no compile-time double rounding).
JF4_HD float kInv6() { return Float(0x3e2aaaabu); }         // fp32(1/6)
JF4_HD float kInv448() { return Float(0x3b124925u); }       // fp32(1/448)
JF4_HD float kInv57344() { return Float(0x37924925u); }     // fp32(1/57344)
JF4_HD float kInv2688() { return Float(0x39c30c31u); }      // fp32(1/2688)
JF4_HD float kWindowFloor() { return Float(0x2b8cbcccu); }  // fp32(1e-12)
constexpr float kEncNumerator = 2688.0f;                     // 6 * 448
JF4_HD float kDecodeAmaxFloor() { return Float(0x05280001u); }  // fp32(2688 / FLT_MAX)
JF4_HD float kInv1536() { return Float(0x3a2aaaabu); }           // fp32(1/1536): 6 * 256, the 4over6 bound
JF4_HD float kDecodeAmaxFloor256() { return Float(0x04c00001u); }  // fp32(1536 / FLT_MAX)

// IEEE fp32 operations, rounded once to nearest even (the host is built with -ffp-contract=off).
JF4_HD float Mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
JF4_HD float Div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
// NVFP4 1D/2D/RHT decode multiplier (reference nvfp4.decode_scale): f = (s_b * A) * fp32(1/2688) with
// A = max(amax, fp32(2688 / FLT_MAX)) for amax > 0 (below it the encode clamped S_enc at FLT_MAX; 0 and NaN stay), and
// s_b * (A * fp32(1/2688)) where s_b * A overflows (amax > 7.6e35). TE's (s_b * amax) * fp32(1/2688) in between.
// bound256: the tensor scale on the 4over6 E4M3 bound 256 (1536 and fp32(1/1536) for 2688 and fp32(1/2688)).
JF4_HD float Nvfp4DecodeScale(float s_b, float amax, bool bound256 = false) {
  const uint32_t b = Bits(amax);  // amax >= 0 or NaN: positive values order like their bits
  const float floor = bound256 ? kDecodeAmaxFloor256() : kDecodeAmaxFloor();
  const float inv = bound256 ? kInv1536() : kInv2688();
  const float a = (b != 0u && b < Bits(floor)) ? floor : amax;
  const float p = Mul(s_b, a);
  const bool overflow = (Bits(p) & 0x7FFFFFFFu) == 0x7F800000u;  // on the bits: the same test on both sides
  return overflow ? Mul(s_b, Mul(a, inv)) : Mul(p, inv);
}

JF4_HD float Rcp(float a) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(a);
#else
  return 1.0f / a;
#endif
}

// fmaxf ignores a NaN operand, so block amaxes never carry NaN. (The host spells fmaxf out: the same result,
// without a libm call.)
JF4_HD float AbsMax(float acc, float v) {
#if defined(__CUDA_ARCH__)
  return fmaxf(acc, fabsf(v));
#else
  const float a = std::fabs(v);
  return a > acc ? a : acc;  // a NaN compares false; acc is never NaN
#endif
}

// ---- host rounding onto a small binary format (the reference's _f32.encode) ---------------------------------------
// RNE of fp32 v onto a format with kMbits mantissa bits and exponent bias kBias (gradual underflow), then saturated
// to the largest finite code kMax (satfinite: overflow and +-inf); NaN -> 0x7F. The sign goes to bit 7.
// Both ranges are computed and one is selected (no branches, no libm calls, so loops over it vectorise):
//  * below the smallest normal (|v| < 2^(1 - kBias)): the code is rint(|v| * 2^(kMbits + kBias - 1)) (multiples of
//    2^(1 - kBias - kMbits)); the product is an exact power-of-two scaling and the sum with 2^23 rounds it once to
//    nearest even (the default rounding mode), leaving the integer in the low mantissa bits. It may reach the first
//    normal code 1 << kMbits exactly;
//  * normal: RNE on the mantissa bits, then the exponent rebiased.
template <int kMbits, int kBias, uint32_t kMax>
inline uint32_t SmallFloatRne(float v) {
  // Compares are on signed ints (|v|'s bits and the selected code are below 2^31; SSE2 has no unsigned compare).
  const uint32_t b = Bits(v), sign = (b >> 24) & 0x80u;
  const int32_t mag = int32_t(b & 0x7FFFFFFFu);
  const float q = Float(uint32_t(mag)) * Float(uint32_t(127 + kMbits + kBias - 1) << 23);
  const int32_t sub = int32_t(Bits(q + 8388608.0f) - 0x4B000000u);  // 8388608 = 2^23
  constexpr int shift = 23 - kMbits;
  const uint32_t r = uint32_t(mag) + ((1u << (shift - 1)) - 1u) + ((uint32_t(mag) >> shift) & 1u);
  const int32_t normal = int32_t(r >> shift) - ((127 - kBias) << kMbits);
  int32_t code = mag < ((128 - kBias) << 23) ? sub : normal;  // exponent below 1 - kBias
  code = (code > int32_t(kMax) || mag >= 0x7F800000) ? int32_t(kMax) : code;
  return mag > 0x7F800000 ? 0x7Fu : (sign | uint32_t(code));
}

// Exact value of a code of such a format (finite codes only): normal codes as fp32 bits, subnormal ones as
// m * 2^(1 - kBias - kMbits) (an exact product: a small integer times a normal power of two).
template <int kMbits, int kBias>
inline float SmallFloatValue(uint32_t code) {
  const uint32_t e = (code >> kMbits) & ((0x7Fu) >> kMbits), m = code & ((1u << kMbits) - 1u);
  const float normal = Float(((e + uint32_t(127 - kBias)) << 23) | (m << (23 - kMbits)));
  const float sub = float(m) * Float(uint32_t(128 - kBias - kMbits) << 23);
  return Float(Bits(e ? normal : sub) | ((code & 0x80u) << 24));
}

// bfloat16 bits of v, RNE, NaN -> 0x7FC0 (the reference's canonical NaN).
JF4_HD uint32_t Bf16Rne(float v) {
  const uint32_t b = Bits(v);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
}

// ---- E4M3 / E5M2 -----------------------------------------------------------------------------------------------
// RNE, satfinite (+-inf and overflow -> +-max), NaN -> 0x7F. Two values per call, `lo` in the low byte.
JF4_HD uint32_t E4M3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
#else
  return SmallFloatRne<3, 7, 0x7Eu>(lo) | (SmallFloatRne<3, 7, 0x7Eu>(hi) << 8);
#endif
}
JF4_HD uint32_t E5M2x2(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E5M2);
#else
  return SmallFloatRne<2, 15, 0x7Bu>(lo) | (SmallFloatRne<2, 15, 0x7Bu>(hi) << 8);
#endif
}
JF4_HD uint32_t E4M3(float v) { return E4M3x2(v, 0.0f) & 0xFFu; }

// Exact value of an E4M3 code (all E4M3 values are fp32 normals or zero). NaN (0x7F/0xFF) is a scale only where a
// 1x64 window holds an infinity (S_enc,w = 0, bamax * 0 = NaN).
JF4_HD float E4M3Value(uint32_t code) {
#if defined(__CUDA_ARCH__)
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(h));
#else
  return (code & 0x7Fu) == 0x7Fu ? Float(0x7FC00000u) : SmallFloatValue<3, 7>(code);  // NaN (a 1x64 window of inf)
#endif
}

// ---- E8M0 (MXFP8 scales) ----------------------------------------------------------------------------------------
// TE float_to_e8m0 of v >= 0: NaN -> 0xFF, inf -> 0xFE, 0 -> 0; else the exponent bits, plus one when the mantissa
// is nonzero, except when they are 0xFE, or 0 with mantissa <= 0x400000 (round toward +inf, saturating).
// Branch-free (it runs once per block and thread in the MXFP8 quantizers): adding 0x7FFFFF (0x3FFFFF in the subnormal
// binade) to the magnitude bits carries into the exponent exactly when it should bump; the min saturates exponent
// 0xFE and maps inf (0xFF after the carry-free add) to 0xFE. Equal to the case-by-case definition on all 2^32 inputs
// (checked on the host when this form was written).
JF4_HD uint32_t E8M0FromFloat(float v) {
  const uint32_t mag = Bits(v) & 0x7FFFFFFFu;
  const uint32_t up = (mag + (mag < 0x800000u ? 0x3FFFFFu : 0x7FFFFFu)) >> 23;
#if defined(__CUDA_ARCH__)
  return mag > 0x7F800000u ? 0xFFu : min(up, 0xFEu);
#else
  return mag > 0x7F800000u ? 0xFFu : (up < 0xFEu ? up : 0xFEu);
#endif
}

// fp32 2^(127 - e): exponent field 254 - e for e <= 253, the subnormal 2^-127 for e = 254, NaN for e = 255 (selects,
// no branches).
JF4_HD float E8M0InverseScale(uint32_t e) {
  const uint32_t r = (254u - e) << 23;
  return Float(e >= 254u ? (e == 254u ? 0x00400000u : 0x7FC00000u) : r);
}

// ---- NVFP4 scale arithmetic -------------------------------------------------------------------------------------
// S_enc = min(2688 / amax, FLT_MAX); 1 when amax == 0 or S_enc == 0 (amax = inf).
// (amax is an amax: >= 0, never NaN; 2688 / amax is never NaN, so the host's compare-selects equal fminf.)
JF4_HD float GlobalEncodeScale(float amax) {
  if (amax == 0.0f) return 1.0f;
#if defined(__CUDA_ARCH__)
  const float s = fminf(__fdiv_rn(kEncNumerator, amax), FLT_MAX);
#else
  const float q = kEncNumerator / amax, s = q > FLT_MAX ? FLT_MAX : q;
#endif
  return s == 0.0f ? 1.0f : s;
}

// 1x64: S_enc,w = min(2688 / max(A_w, 1e-12), FLT_MAX); 1 when A_w == 0; NaN for a NaN A_w (the decode of a window
// that held a NaN, docs/numerics.md section 6; the encode's window amax ignores NaNs).
JF4_HD float WindowEncodeScale(float window_amax) {
  if (window_amax != window_amax) return window_amax;  // NaN (a window that held a NaN): its decode is NaN
  if (window_amax == 0.0f) return 1.0f;
#if defined(__CUDA_ARCH__)
  return fminf(__fdiv_rn(kEncNumerator, fmaxf(window_amax, kWindowFloor())), FLT_MAX);
#else
  const float q = kEncNumerator / (window_amax > kWindowFloor() ? window_amax : kWindowFloor());
  return q > FLT_MAX ? FLT_MAX : q;
#endif
}

// ---- Philox-4x32-10 (Salmon et al. 2011), the stochastic-rounding stream of reference/sr.py -------------------------
#if defined(__CUDACC__)
using Words4 = uint4;
JF4_HD Words4 MakeWords4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return make_uint4(a, b, c, d); }
#else
struct Words4 {
  uint32_t x, y, z, w;
};
inline Words4 MakeWords4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return Words4{a, b, c, d}; }
#endif

JF4_HD uint32_t MulHi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return uint32_t((uint64_t(a) * b) >> 32);
#endif
}

JF4_HD Words4 Philox(uint32_t ctr, uint32_t k0, uint32_t k1) {
  uint32_t c0 = ctr, c1 = 0, c2 = 0, c3 = 0;
  JF4_UNROLL
  for (int r = 0; r < 10; ++r) {
    if (r) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint32_t hi0 = MulHi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const uint32_t hi1 = MulHi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  return MakeWords4(c0, c1, c2, c3);
}

// ---- Random Hadamard transform of one 16-chunk (reference/rht.py) --------------------------------------------------
// Signs (mask 0xD7E8), butterfly over strides 1, 2, 4, 8, * 0.25, each step flushed to signed zero, then RNE to bf16.
// flush(x): x, or a zero of x's sign where |x| < FLT_MIN.

// fp32 add / subtract with subnormal inputs and results flushed to sign-preserving zero (add.rn.ftz.f32): equal to
// flush(flush(a) + flush(b)), as a sum of floats that is below FLT_MIN is exact (no rounding happens in the subnormal
// range, so flushing before or after rounding agrees).
// flush(x) on the host: a zero of x's sign where x is subnormal.
JF4_HD float Flush(float x) {
  const uint32_t b = Bits(x);
  return (b & 0x7F800000u) == 0 ? Float(b & 0x80000000u) : x;
}
JF4_HD float AddFtz(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("add.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return Flush(Flush(a) + Flush(b));
#endif
}
JF4_HD float SubFtz(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("sub.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return Flush(Flush(a) - Flush(b));
#endif
}

constexpr uint32_t kRhtSignMask = 0xD7E8u;  // bit i: element i is negated (forward: input; inverse: output)

// The four butterfly stages (a, b) -> (a + b, a - b) of the RHT, each sum flushed (the first stage also flushes its
// inputs).
JF4_HD void RhtButterfly16(float (&v)[16]) {
  JF4_UNROLL
  for (int h = 1; h < 16; h <<= 1) {
    JF4_UNROLL
    for (int i = 0; i < 16; ++i) {
      if ((i & h) == 0) {
        const float x = v[i], y = v[i + h];
        v[i] = AddFtz(x, y);
        v[i + h] = SubFtz(x, y);
      }
    }
  }
}

// Forward RHT: flush, signs, butterfly (flushed), * 0.25 (flushed), RNE to bf16. The input flush rides on the first
// stage's ftz adds: negating first and flushing after gives the same signed zero as flushing first (and -NaN is the
// sign-flipped NaN either way). The product is flushed with an ftz add of -0 (x + -0 == x, -0 + -0 == -0), not
// taken with mul.ftz: an exact product just below FLT_MIN that rounds up to FLT_MIN must stay FLT_MIN, which a flush
// decided before rounding would not guarantee. Bit for bit the step-by-step flushed form of reference/rht.py,
// in 8 instructions an element instead of 21 (SASS of sm_90a: the negations fold into the first adds; the flushes
// of the step-by-step form cost 2-3 instructions each).
JF4_HD void RhtForward16(float (&v)[16]) {
  JF4_UNROLL
  for (int i = 0; i < 16; ++i) v[i] = ((kRhtSignMask >> i) & 1u) ? -v[i] : v[i];
  RhtButterfly16(v);
#if defined(__CUDA_ARCH__)
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = __bfloat162float(__float2bfloat16_rn(AddFtz(__fmul_rn(v[i], 0.25f), -0.0f)));
#else
  for (int i = 0; i < 16; ++i) v[i] = Float(Bf16Rne(Flush(v[i] * 0.25f)) << 16);
#endif
}

}  // namespace cvt
}  // namespace jax_fp4
