// The on-chip decode of the Hopper block-scaled GEMM (gemm/gemm_sm90.cuh): one thread's half row of a 64-wide K-tile
// (32 codes with their block scales) into exact bfloat16 values, stored as 16-byte chunks of a 128-byte-swizzled,
// K-major shared-memory tile (the WGMMA operand layout). docs/kernels/gemm.md, "Decode on chip".
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/convert.cuh"
#include "common/ffi_codes.h"
#include "dequantize/decode.cuh"
#include "dequantize/half_table.cuh"

namespace jax_fp4 {
namespace gemm {

// The codes (and scales) of one thread's half row of a K-tile: 32 codes from k0 = kt * 64 + 32 * half.
struct Fp4Regs {
  uint2 d[2];     // two 16-code blocks (8 bytes each)
  uint32_t s[2];  // their E4M3 block scales
};
struct Fp8Regs {
  uint4 d[2];  // one 32-code block
  uint32_t s;  // its E8M0 block scale
};

// The 1x64 decode factor RN(1 / S_enc,w) of a window with amax A: S_enc,w = min(2688 / max(A, 1e-12), FLT_MAX),
// 1 for A == 0 (docs/numerics.md section 1, the reference's quantize_1x64 / dequantize), both divisions IEEE. A NaN
// amax (a window that held a NaN) gives NaN, as the reference's decode (docs/numerics.md section 6).
__device__ __forceinline__ float WindowFactor(float amax) {
  constexpr float kFltMax = 3.402823466e38f;
  if (amax == 0.0f) return 1.0f;
  if (amax != amax) return amax;
  return __fdiv_rn(1.0f, fminf(__fdiv_rn(2688.0f, fmaxf(amax, cvt::kWindowFloor())), kFltMax));
}

// Stores 8 bf16 values (16 bytes) at row `r`, columns 8c .. 8c + 7 of stage `st` of the swizzled tile `s` (the
// CuTe tensor computes the swizzled address; st.shared, as a generic store would check the address space per access).
template <typename STensor>
__device__ __forceinline__ void Store8(STensor& s, int r, int c, int st, uint4 v) {
  const uint32_t addr = uint32_t(__cvta_generic_to_shared(&s(r, 8 * c, st)));
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// The byte table of the 8 bf16 values value(q) * s_b of an NVFP4 block (dequantize/half_table.cuh). For a positive
// finite scale (E4M3 codes 0x01..0x7E: s_b in [2^-9, 448], normal in bf16) the products are exact and the table
// comes from two of them by exponent arithmetic: P = (bf16(s_b), bf16(1.5 s_b)) is the pair of magnitudes (1, 1.5);
// (2, 3) and (4, 6) add 1 and 2 to both exponents; (0, 0.5) is (+0, bf16(s_b) with the exponent decremented). Other
// codes (zero, negative, NaN) take the per-magnitude multiplications.
__device__ __forceinline__ dequantize::HalfTable Fp4Table(uint32_t scale_code) {
  const float sb = dequantize::Fp8Value<codes::kMxfp8E4m3>(scale_code);
  if (scale_code - 1u < 0x7Eu) {
    const __nv_bfloat162 pb = __floats2bfloat162_rn(sb, __fmul_rn(1.5f, sb));  // exact
    const uint32_t p = *reinterpret_cast<const uint32_t*>(&pb);
    const uint32_t t[4] = {(p << 16) - 0x00800000u, p, p + 0x00800080u, p + 0x01000100u};
    return dequantize::HalfTableOfPairs(t);
  }
  return dequantize::MakeHalfTable<__nv_bfloat16>(sb);
}

// Decodes one thread's 32 NVFP4 codes (two 16-blocks) into chunks 4 * half .. 4 * half + 3 of row r: the block's
// 8 magnitudes times s_b round once into a byte table (value(q) * s_b has <= 6 significant bits: exact in bf16).
template <typename STensor>
__device__ __forceinline__ void DecodeFp4(const Fp4Regs& r, STensor& s, int row, int half, int st) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const dequantize::HalfTable tab = Fp4Table(r.s[j]);
    Store8(s, row, 4 * half + 2 * j, st, dequantize::TableRun8(tab, r.d[j].x));
    Store8(s, row, 4 * half + 2 * j + 1, st, dequantize::TableRun8(tab, r.d[j].y));
  }
}

// bf16 bits of the emulation's MXFP8 operand value of one code under E8M0 code e (dequantize::MxDecode with bf16's
// range): the general path's treatment of a half whose bf16x2 product overflowed (out of line: rare).
template <__nv_fp8_interpretation_t kElem>
__device__ __noinline__ uint32_t MxBf16(uint32_t code, uint32_t e) {
  constexpr int kKind = kElem == __NV_E4M3 ? codes::kMxfp8E4m3 : codes::kMxfp8E5m2;
  const float v = dequantize::MxDecode<kKind>(code, dequantize::E8M0Value(e), dequantize::kBf16MaxBits);
  return dequantize::OutBits<__nv_bfloat16>(v);
}

// The general MXFP8 decode of one thread's 32 codes: RN_bf16(value * 2^(e-127)) for every code and scale. Per pair of
// codes: one fp8x2 -> f16x2 conversion, two exact widenings, one exact bf16x2 pack (E4M3 / E5M2 values have <= 4
// significant bits and lie in [2^-16, 57344], normal in bf16), and one bf16x2 multiply by the scale 2^(e-127) held
// as a bf16 (2^-127 is a bf16 subnormal, e = 255 NaN), correctly rounded with subnormals kept. The exact product's
// lowest bit is >= 2^-143, so it is exact in fp32 and this single rounding equals the emulation's
// RN_bf16(RN_f32(value * scale)). An infinite half is redone by MxBf16: a code that rounded up past bf16's range
// gives bf16 max, as the emulation's dequantize (docs/numerics.md section 2, Dequantize).
template <__nv_fp8_interpretation_t kElem, typename STensor>
__device__ __noinline__ void DecodeFp8General(const Fp8Regs& r, STensor& s, int row, int half, int st) {
  const uint32_t e = r.s & 0xFFu;
  const uint32_t sb = e == 255u ? 0x7FC0u : (e == 0u ? 0x0040u : e << 7);
  const uint32_t sb2 = sb | (sb << 16);
  const __nv_bfloat162 sc = *reinterpret_cast<const __nv_bfloat162*>(&sb2);
  const uint32_t w[8] = {r.d[0].x, r.d[0].y, r.d[0].z, r.d[0].w, r.d[1].x, r.d[1].y, r.d[1].z, r.d[1].w};
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    uint32_t o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t word = w[2 * c + i / 2];
      const uint32_t pair = (i & 1) ? (word >> 16) : (word & 0xFFFFu);
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), kElem);
      const float2 f = __half22float2(__half2(h));
      const __nv_bfloat162 b = __hmul2_rn(__floats2bfloat162_rn(f.x, f.y), sc);
      o[i] = *reinterpret_cast<const uint32_t*>(&b);
      if ((o[i] & 0x7FFFu) == 0x7F80u) o[i] = (o[i] & 0xFFFF0000u) | MxBf16<kElem>(pair & 0xFFu, e);
      if ((o[i] & 0x7FFF0000u) == 0x7F800000u) o[i] = (o[i] & 0xFFFFu) | (MxBf16<kElem>(pair >> 8, e) << 16);
    }
    Store8(s, row, 4 * half + c, st, make_uint4(o[0], o[1], o[2], o[3]));
  }
}

// The MXFP8 decode of one thread's 32 codes, integer arithmetic and one bf16x2 multiply per pair of codes.
//
// The code bits (s, the 7 magnitude bits) placed into a bf16 (sign to bit 15, E4M3's eeeemmm to bits 4..10, E5M2's
// eeeeemm to bits 5..11) are the bf16 of value * 2^-120 (E4M3) / value * 2^-112 (E5M2) exactly, subnormal codes
// included (exponent field 0 reads as a bf16 subnormal with the same mantissa). One bf16x2 multiply by the power of
// two 2^(e-7) / 2^(e-15) then gives RN_bf16(value * 2^(e-127)), the emulation's operand value (the exact product is
// exact in fp32, see DecodeFp8General), with subnormals kept by mul.rn.bf16x2. The factor is a normal bf16 for
// e <= 134 (E4M3) / e <= 142 (E5M2), where no code overflows either; blocks with a larger e (or the NaN scale 255), or
// holding a NaN (E4M3 s.1111.111) or Inf / NaN (E5M2 s.11111.xx) code, whose placed bits read as finite values, take
// DecodeFp8General. The NaN test per 4 codes: (w & M) + A sets bit 7 of exactly the bytes with those codes (no carry
// leaves a byte).
template <__nv_fp8_interpretation_t kElem, typename STensor>
__device__ __forceinline__ void DecodeFp8(const Fp8Regs& r, STensor& s, int row, int half, int st) {
  constexpr bool kE4m3 = kElem == __NV_E4M3;
  constexpr uint32_t kMask = kE4m3 ? 0x7F7F7F7Fu : 0x7C7C7C7Cu, kAdd = kE4m3 ? 0x01010101u : 0x04040404u;
  constexpr uint32_t kMaxE = kE4m3 ? 134u : 142u, kBias = kE4m3 ? 120u : 112u;
  const uint32_t w[8] = {r.d[0].x, r.d[0].y, r.d[0].z, r.d[0].w, r.d[1].x, r.d[1].y, r.d[1].z, r.d[1].w};
  uint32_t special = 0u;
#pragma unroll
  for (int i = 0; i < 8; ++i) special |= (w[i] & kMask) + kAdd;
  const uint32_t e = r.s & 0xFFu;
  if ((special & 0x80808080u) != 0u || e > kMaxE) {
    DecodeFp8General<kElem>(r, s, row, half, st);
    return;
  }
  const uint32_t f = (e + kBias) << 7;
  const uint32_t f2 = f | (f << 16);
  const __nv_bfloat162 factor = *reinterpret_cast<const __nv_bfloat162*>(&f2);
  // x = two codes in the high bytes of two 16-bit halves: [c1, 0, c0, 0] (bytes 3..0).
  auto place = [](uint32_t x) -> __nv_bfloat162 {
    const uint32_t b = kE4m3 ? (((x >> 4) & 0x07F007F0u) | (x & 0x80008000u))
                             : (((x >> 3) & 0x0FE00FE0u) | (x & 0x80008000u));
    return *reinterpret_cast<const __nv_bfloat162*>(&b);
  };
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    uint32_t o[4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t word = w[2 * c + i];
      const __nv_bfloat162 lo = __hmul2_rn(place(__byte_perm(word, 0u, 0x1404u)), factor);
      const __nv_bfloat162 hi = __hmul2_rn(place(__byte_perm(word, 0u, 0x3424u)), factor);
      o[2 * i] = *reinterpret_cast<const uint32_t*>(&lo);
      o[2 * i + 1] = *reinterpret_cast<const uint32_t*>(&hi);
    }
    Store8(s, row, 4 * half + c, st, make_uint4(o[0], o[1], o[2], o[3]));
  }
}

}  // namespace gemm
}  // namespace jax_fp4
