// E2M1 encoding of 16 scaled values into 8 packed bytes (NUMERICS.md: NVFP4 element encode, stochastic rounding).
//
// Hopper has no E2M1 instruction, and the encode is the hot loop of every NVFP4 quantizer, so the sm_90 path uses
// the fp32 adder instead of seven threshold compares:
//   * clamp: c = max(min(y, 6), -6). min first, so NaN -> +6 (the canonical NaN code 0x7), -inf -> -6, and the sign
//     of zero is kept. The magnitude a = |c| lies on [0, 6].
//   * binade: e = 2^floor(log2 a) clamped below to 1, i.e. e in {1, 2, 4}; the E2M1 grid step on [0, 2), [2, 4),
//     [4, 6] is e / 2, so with s = 2 / e the grid becomes the integers shifted by off = 2 log2(e) in {0, 2, 4}.
//   * RNE: r = fma(-a, s, 1.5 * 2^23 - off). a * s is exact, so the one rounding of the FFMA (to an integer: the ulp
//     at 1.5 * 2^23 is 1) is the round-half-even of a * s subtracted from an even integer; ties go to the even E2M1
//     code. The code rint(a * s) + off <= 7 is bits(1.5 * 2^23) - bits(r). Subtracting lets s come straight from
//     a's exponent field, s = 2^(128 - E) capped at 2 (bits: min(~bits(a) & 0x7F800000, 0x40000000)), and
//     1.5 * 2^23 - off = 1.5 * 2^23 - 256 + 2 (128 - E') from s's bits shifted right by 22: three integer
//     instructions per value where the additive form took four (e, then s and the offset from it).
//   * stochastic rounding (TE PR #3281, reference/sr.py): t = a + (rand / 256) * step with step = e / 2, rounded once
//     (FFMA of the exact product), then floor(t * s) + off through the same FFMA in round-toward-zero.
// tests/test_e2m1_exhaustive.py checks both against the threshold definitions on every fp32 input (host build of
// this header). The sm_100a path uses cvt.rn.satfinite.e2m1x2.f32 for RNE (compiled, not runnable on Hopper).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define JF4_HD __host__ __device__ __forceinline__
#else
#include <cmath>
#define JF4_HD inline
#endif
// `#pragma unroll` for the device pass only (the host compiler does not know it and warns under -Wall).
#if defined(__CUDA_ARCH__)
#define JF4_UNROLL _Pragma("unroll")
#else
#define JF4_UNROLL
#endif

namespace jax_fp4 {
namespace e2m1 {

JF4_HD uint32_t Bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

JF4_HD float Float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

constexpr uint32_t kMagic = 0x4B400000u;  // bits of 1.5 * 2^23

// sum over i < 8 of (kMagic << 4i) mod 2^32: what eight packed magic-biased codes carry above their nibbles.
constexpr uint32_t MagicSum() {
  uint32_t s = 0;
  for (int i = 0; i < 8; ++i) s += kMagic << (4 * i);
  return s;
}

JF4_HD float Clamp6(float y) {
#if defined(__CUDA_ARCH__)
  return fmaxf(fminf(y, 6.0f), -6.0f);  // PTX min/max return the non-NaN operand
#else
  return y != y ? 6.0f : (y > 6.0f ? 6.0f : (y < -6.0f ? -6.0f : y));  // the same on the host (no minss rules)
#endif
}

// Exponent bits of e = max(2^floor(log2 |c|), 1) for |c| <= 6: 0x3F800000, 0x40000000 or 0x40800000. (The mask
// drops the sign, so callers pass c itself rather than a materialised |c|.)
JF4_HD uint32_t BinadeBits(float c) {
  const uint32_t e = Bits(c) & 0x7F800000u;
  return e > 0x3F800000u ? e : 0x3F800000u;
}

// kMagic - the RNE code of |c|, c = Clamp6(y) (or its magnitude).
JF4_HD uint32_t MagnitudeRne(float c) {
  const float a = fabsf(c);
  const uint32_t sb = ~Bits(c) & 0x7F800000u;                         // 2^(128 - E), E the exponent field of a
  const uint32_t s_bits = sb < 0x40000000u ? sb : 0x40000000u;         // s = 2 / e, e = max(2^floor(log2 a), 1)
  const float moff = Float((s_bits >> 22) + (kMagic - 256u));        // 1.5 * 2^23 - 2 log2(e)
#if defined(__CUDA_ARCH__)
  return __float_as_uint(__fmaf_rn(-a, Float(s_bits), moff));
#else
  return Bits(std::fmaf(-a, Float(s_bits), moff));
#endif
}

// kMagic + the stochastically rounded code of |c|, c = Clamp6(y), with random byte r.
JF4_HD uint32_t MagnitudeSr(float c, uint32_t r) {
  const float a = fabsf(c);
  const uint32_t e = BinadeBits(c);
  const float s = Float(0x7F800000u - e);
  const float moff = Float((e >> 22) + (kMagic - 0xFEu));
  const float step256 = Float(e - (9u << 23));                 // step / 256 = e / 512
  const float rf = Float(0x4B000000u | r) - 8388608.0f;        // r as a float, exactly
#if defined(__CUDA_ARCH__)
  const float t = __fmaf_rn(rf, step256, a);                   // a + r * step / 256, one rounding
  return __float_as_uint(__fmaf_rz(t, s, moff));               // moff + floor(t * s)
#else
  const float t = std::fmaf(rf, step256, a);
  return Bits(std::floor(t * s) + moff);                       // t * s is exact; the sum is exact
#endif
}

// Byte k of d = byte sel_k of {b:a} (index 0..7), or, when bit 3 of sel_k is set, that byte's sign bit replicated
// over all 8 bits (PTX prmt.b32, default mode).
JF4_HD uint32_t Permute(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
#else
  const uint64_t src = (uint64_t(b) << 32) | a;
  uint32_t d = 0;
  for (int k = 0; k < 4; ++k) {
    const uint32_t n = (sel >> (4 * k)) & 0xFu;
    uint32_t byte = uint32_t(src >> (8 * (n & 7u))) & 0xFFu;
    if (n & 8u) byte = (byte & 0x80u) ? 0xFFu : 0u;
    d |= byte << (8 * k);
  }
  return d;
#endif
}

// Sign bits of c[0..7] at bits 4j + 3 (the sign bit of nibble j). Byte permutes with sign replication gather the even
// elements' signs as whole bytes into one word and the odd elements' into another; a nibble select interleaves them:
// 8 instructions for 8 values instead of a shift and a mask each.
JF4_HD uint32_t Signs8(const float (&c)[8]) {
  const uint32_t even = Permute(Permute(Bits(c[0]), Bits(c[2]), 0xFBu), Permute(Bits(c[4]), Bits(c[6]), 0xFBu), 0x5410u);
  const uint32_t odd = Permute(Permute(Bits(c[1]), Bits(c[3]), 0xFBu), Permute(Bits(c[5]), Bits(c[7]), 0xFBu), 0x5410u);
  return ((even & 0x0F0F0F0Fu) | (odd & 0xF0F0F0F0u)) & 0x88888888u;
}

// Random byte j (0..15) of a Philox output, little-endian within each word.
JF4_HD uint32_t RandomByte(const uint32_t (&r)[4], int j) { return (r[j >> 2] >> (8 * (j & 3))) & 0xFFu; }

// 8 values y[i] = v[i] * mult (fp32 RN products) -> 8 E2M1 codes packed low nibble first.
template <bool kSr>
JF4_HD uint32_t Pack8(const float* v, float mult, const uint32_t (&rnd)[4], int byte0) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 1000) && defined(__CUDA_ARCH_FEAT_SM100_ALL)
  if constexpr (!kSr) {  // Blackwell: the conversion instruction (Clamp6 has already turned NaN into +6)
    uint32_t packed = 0;
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      const float lo = Clamp6(__fmul_rn(v[j], mult)), hi = Clamp6(__fmul_rn(v[j + 1], mult));
      uint16_t b;
      asm("{\n .reg .b8 t;\n cvt.rn.satfinite.e2m1x2.f32 t, %1, %2;\n cvt.u16.u8 %0, t;\n}" : "=h"(b) : "f"(hi), "f"(lo));
      packed |= uint32_t(b) << (4 * j);
    }
    return packed;
  }
#endif
  uint32_t acc = 0;
  float c[8];
  JF4_UNROLL
  for (int j = 0; j < 8; ++j) {
#if defined(__CUDA_ARCH__)
    // One FMNMX instead of Clamp6's two: the magnitude is min(|y|, 6) (NaN -> 6) and the sign comes from y itself,
    // which equals Clamp6's sign for every non-NaN y; a NaN product is the positive canonical NaN on the GPU, so NaN
    // still encodes as +6 (code 0x7), as Clamp6 gives (tests/test_quantize_kernels.py special inputs).
    c[j] = __fmul_rn(v[j], mult);
    const float mag = fminf(fabsf(c[j]), 6.0f);
#else
    c[j] = Clamp6(v[j] * mult);
    const float mag = c[j];
#endif
    const uint32_t r = kSr ? MagnitudeSr(mag, RandomByte(rnd, byte0 + j)) : MagnitudeRne(mag);
    acc += r << (4 * j);
  }
  // RNE fields are kMagic - code, SR fields kMagic + code (the carries of the sum cancel against MagicSum either way).
  return (kSr ? acc - MagicSum() : MagicSum() - acc) | Signs8(c);
}

}  // namespace e2m1
}  // namespace jax_fp4
