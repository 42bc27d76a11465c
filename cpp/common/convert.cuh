// Conversions and scale arithmetic of the numeric contract (docs/numerics.md), as device functions.
//
// Every function here is bit-exact to jax_fp4.reference:
//  * fp32 products / quotients use the IEEE intrinsics (__fmul_rn, __frcp_rn, __fdiv_rn): no contraction into FMAs,
//    no flush-to-zero (the library is built with -ftz=false -prec-div=true);
//  * E4M3 / E5M2 use cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 (sm_89+, so Hopper runs them natively);
//  * E2M1 encoding lives in e2m1.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

namespace jax_fp4 {
namespace cvt {

// fp32 constants by bit pattern (np.float32 of the exact quotient; no compile-time double rounding).
__device__ __forceinline__ float kInv6() { return __uint_as_float(0x3e2aaaabu); }        // fp32(1/6)
__device__ __forceinline__ float kInv448() { return __uint_as_float(0x3b124925u); }      // fp32(1/448)
__device__ __forceinline__ float kInv57344() { return __uint_as_float(0x37924925u); }    // fp32(1/57344)
__device__ __forceinline__ float kInv2688() { return __uint_as_float(0x39c30c31u); }     // fp32(1/2688)
__device__ __forceinline__ float kWindowFloor() { return __uint_as_float(0x2b8cbcccu); } // fp32(1e-12)
constexpr float kEncNumerator = 2688.0f;                                                   // 6 * 448

// fmaxf ignores a NaN operand, so block amaxes never carry NaN.
__device__ __forceinline__ float AbsMax(float acc, float v) { return fmaxf(acc, fabsf(v)); }

// ---- E4M3 / E5M2 -----------------------------------------------------------------------------------------------
// RNE, satfinite (+-inf and overflow -> +-max), NaN -> 0x7F. Two values per call, `lo` in the low byte.
__device__ __forceinline__ uint32_t E4M3x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ uint32_t E5M2x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E5M2);
}
__device__ __forceinline__ uint32_t E4M3(float v) { return E4M3x2(v, 0.0f) & 0xFFu; }

// Exact value of an E4M3 code (all E4M3 values are fp32 normals or zero); 0x7F/0xFF (NaN) never occur as scales.
__device__ __forceinline__ float E4M3Value(uint32_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(h));
}

// ---- E8M0 (MXFP8 scales) ----------------------------------------------------------------------------------------
// TE float_to_e8m0 of v >= 0: NaN -> 0xFF, inf -> 0xFE, 0 -> 0; else the exponent bits, plus one when the mantissa
// is nonzero, except when they are 0xFE, or 0 with mantissa <= 0x400000 (round toward +inf, saturating).
// Branch-free (it runs once per block and thread in the MXFP8 quantizers): adding 0x7FFFFF (0x3FFFFF in the subnormal
// binade) to the magnitude bits carries into the exponent exactly when it should bump; the min saturates exponent
// 0xFE and maps inf (0xFF after the carry-free add) to 0xFE. Equal to the case-by-case definition on all 2^32 inputs
// (checked on the host when this form was written).
__device__ __forceinline__ uint32_t E8M0FromFloat(float v) {
  const uint32_t mag = __float_as_uint(v) & 0x7FFFFFFFu;
  const uint32_t up = (mag + (mag < 0x800000u ? 0x3FFFFFu : 0x7FFFFFu)) >> 23;
  return mag > 0x7F800000u ? 0xFFu : min(up, 0xFEu);
}

// fp32 2^(127 - e): exponent field 254 - e for e <= 253, the subnormal 2^-127 for e = 254, NaN for e = 255 (selects,
// no branches).
__device__ __forceinline__ float E8M0InverseScale(uint32_t e) {
  const uint32_t r = (254u - e) << 23;
  return __uint_as_float(e >= 254u ? (e == 254u ? 0x00400000u : 0x7FC00000u) : r);
}

// ---- NVFP4 scale arithmetic -------------------------------------------------------------------------------------
// S_enc = min(2688 / amax, FLT_MAX); 1 when amax == 0 or S_enc == 0 (amax = inf).
__device__ __forceinline__ float GlobalEncodeScale(float amax) {
  if (amax == 0.0f) return 1.0f;
  const float s = fminf(__fdiv_rn(kEncNumerator, amax), FLT_MAX);
  return s == 0.0f ? 1.0f : s;
}

// 1x64: S_enc,w = min(2688 / max(A_w, 1e-12), FLT_MAX); 1 when A_w == 0.
__device__ __forceinline__ float WindowEncodeScale(float window_amax) {
  if (window_amax == 0.0f) return 1.0f;
  return fminf(__fdiv_rn(kEncNumerator, fmaxf(window_amax, kWindowFloor())), FLT_MAX);
}

// ---- Philox-4x32-10 (Salmon et al. 2011), the stochastic-rounding stream of reference/sr.py -------------------------
__device__ __forceinline__ uint4 Philox(uint32_t ctr, uint32_t k0, uint32_t k1) {
  uint32_t c0 = ctr, c1 = 0, c2 = 0, c3 = 0;
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  return make_uint4(c0, c1, c2, c3);
}

// ---- Random Hadamard transform of one 16-chunk (reference/rht.py) --------------------------------------------------
// Signs (mask 0xD7E8), butterfly over strides 1, 2, 4, 8, * 0.25, each step flushed to signed zero, then RNE to bf16.
// flush(x): x, or a zero of x's sign where |x| < FLT_MIN.

// fp32 add / subtract with subnormal inputs and results flushed to sign-preserving zero (add.rn.ftz.f32): equal to
// flush(flush(a) + flush(b)), as a sum of floats that is below FLT_MIN is exact (no rounding happens in the subnormal
// range, so flushing before or after rounding agrees).
__device__ __forceinline__ float AddFtz(float a, float b) {
  float r;
  asm("add.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float SubFtz(float a, float b) {
  float r;
  asm("sub.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

constexpr uint32_t kRhtSignMask = 0xD7E8u;  // bit i: element i is negated (forward: input; inverse: output)

// The four butterfly stages (a, b) -> (a + b, a - b) of the RHT, each sum flushed (the first stage also flushes its
// inputs).
__device__ __forceinline__ void RhtButterfly16(float (&v)[16]) {
#pragma unroll
  for (int h = 1; h < 16; h <<= 1) {
#pragma unroll
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
__device__ __forceinline__ void RhtForward16(float (&v)[16]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = ((kRhtSignMask >> i) & 1u) ? -v[i] : v[i];
  RhtButterfly16(v);
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = __bfloat162float(__float2bfloat16_rn(AddFtz(__fmul_rn(v[i], 0.25f), -0.0f)));
}

}  // namespace cvt
}  // namespace jax_fp4
