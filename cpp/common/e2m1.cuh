// E2M1 encoding of 16 scaled values into 8 packed bytes (docs/numerics.md: NVFP4 element encode, stochastic rounding).
//
// Hopper has no E2M1 instruction, and the encode is the hot loop of every NVFP4 quantizer, which is bound by the
// integer ALU pipe (ncu: 76 % of its peak for NVFP4 row+col), so the sm_90 path does its rounding in the
// fp32 adder (FMA pipe) and keeps the ALU work to two instructions a value:
//   * RNE: on [0, 6] the code is rint(g(a)) with g(a) = min(2a, a + 2, a / 2 + 4), a = |y|: g is linear with a
//     power-of-two slope on each E2M1 binade ([0, 2) step 0.5, [2, 4) step 1, [4, 6] step 2), maps the grid onto the
//     integers 0..7 and each midpoint onto a half-integer, so round-half-even of g gives the even E2M1 code on ties.
//     Each term is rounded once by an FFMA / FADD that adds 1.5 * 2^23 (ulp 1 there, an even integer: ties to even),
//     and rint is monotone, so rint(min(...)) = min(rint(...)): the three sums are compared as integers (all share
//     1.5 * 2^23's exponent; NaN / inf sums are larger) by one VIMNMX3 (a sm_90 DPX instruction) and clamped to code 7
//     by one VIMNMX, which also maps |y| > 6, inf and NaN to 7 (the sign comes from y: NaN products are positive on
//     the GPU). No clamp is needed before. This replaced clamp + binade (LOP3, VIMNMX, LEA.HI) + FFMA: ALU-pipe
//     instructions of the NVFP4 row+col tile loop 270 -> 206, total unchanged (docs/kernels/quantize.md).
//   * stochastic rounding (TE PR #3281, reference/sr.py) keeps a binade form on c = max(min(y, 6), -6) (min first:
//     NaN -> +6), a = |c|: e = 2^floor(log2 a) clamped below to 1 (e in {1, 2, 4}), step = e / 2, s = 2 / e,
//     off = 2 log2(e); t = a + (rand / 256) * step, rounded once (FFMA of the exact product), then floor(t * s) + off
//     through an FFMA in round-toward-zero.
// tests/test_e2m1_exhaustive.py checks both against the threshold definitions on every fp32 input (host build of
// this header; RNE on unclamped inputs, as the kernels call it). The sm_100a path uses cvt.rn.satfinite.e2m1x2.f32
// for RNE (compiled, not runnable on Hopper). 12582912 = 1.5 * 2^23, the float of kMagic.
#pragma once

#include <cstdint>
#include <cstring>

#include <cmath>

#include "common/hd.h"

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

// kMagic + the RNE code of min(|y|, 6), NaN -> 7, for any fp32 y (no clamp needed before it).
JF4_HD uint32_t MagnitudeRne(float y) {
  const float a = fabsf(y);
#if defined(__CUDA_ARCH__)
  const int r1 = __float_as_int(__fmaf_rn(a, 2.0f, 12582912.0f));   // kMagic + rint(2a)
  const int r2 = __float_as_int(__fadd_rn(a, 12582914.0f));         // kMagic + rint(a) + 2
  const int r3 = __float_as_int(__fmaf_rn(a, 0.5f, 12582916.0f));   // kMagic + rint(a / 2) + 4
  return uint32_t(min(__vimin3_s32(r1, r2, r3), int(kMagic + 7u)));  // VIMNMX3 (sm_90 DPX) + VIMNMX
#else
  // The products are exact (a power-of-two scaling; a subnormal a / 2 that rounds is far below the magic's ulp, and
  // an a * 2 that overflows gives inf either way), so each sum is the FMA's single rounding without an FMA (the
  // baseline x86-64 target has none: std::fmaf would be a library call).
  const int r1 = int(Bits(a * 2.0f + 12582912.0f));
  const int r2 = int(Bits(a + 12582914.0f));
  const int r3 = int(Bits(a * 0.5f + 12582916.0f));
  const int m = r1 < r2 ? r1 : r2, m3 = m < r3 ? m : r3;
  return uint32_t(m3 < int(kMagic + 7u) ? m3 : int(kMagic + 7u));
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
  const float t = rf * step256 + a;  // rf * step256 is exact (8 bits times a power of two): one rounding, as the FMA
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
#if !defined(__CUDA_ARCH__)  // the host has no byte permute: the same bits by shifts
  uint32_t s = 0;
  for (int j = 0; j < 8; ++j) s |= (Bits(c[j]) >> 31) << (4 * j + 3);
  return s;
#endif
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
    // The sign comes from y itself, which equals Clamp6's sign for every non-NaN y; a NaN product is the positive
    // canonical NaN on the GPU, so NaN still encodes as +6 (code 0x7), as Clamp6 gives (tests/test_quantize_kernels.py
    // special inputs). MagnitudeRne clamps by itself; SR takes min(|y|, 6) (NaN -> 6).
    c[j] = __fmul_rn(v[j], mult);
    const uint32_t r = kSr ? MagnitudeSr(fminf(fabsf(c[j]), 6.0f), RandomByte(rnd, byte0 + j)) : MagnitudeRne(c[j]);
#else
    c[j] = Clamp6(v[j] * mult);
    const uint32_t r = kSr ? MagnitudeSr(c[j], RandomByte(rnd, byte0 + j)) : MagnitudeRne(c[j]);
#endif
    acc += r << (4 * j);
  }
  // Both fields are kMagic + code: the carries of the sum cancel against MagicSum.
  return (acc - MagicSum()) | Signs8(c);
}

}  // namespace e2m1
}  // namespace jax_fp4
