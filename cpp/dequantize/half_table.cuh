// NVFP4 dequantize to 16-bit outputs by table lookup (docs/numerics.md s1-3): within one 16-block every output is
// a function of its code's magnitude (8 values) and sign, because value(q) * m rounds sign-symmetrically. A block
// therefore rounds its 8 magnitudes once into a byte-split table, and each code looks up its output's low and high
// bytes with one byte permute each (selector: the codes' magnitude bits); the code's sign flips bit 15.
//  * 1D / 2D (MakeHalfTable): the 8 products RN(RN_f32(q * m)), m = s_b * amax / 2688 (or s_b), as the per-element
//    path (PackPair) rounds them.
//  * 1x64 (MakeLocalHalfTable): RN_f32(q * s_b / S_enc,w) then RN to Out. q * s_b is exact and every magnitude is
//    2^k or 3 * 2^k (0.5, 1, 2, 4 / 1.5, 3, 6), so the 8 quotients are d1 = RN(s_b / enc) and d3 = RN(3 s_b / enc)
//    scaled by powers of two: exact while everything stays normal, which WindowDivisor::Safe with a finite s_b
//    guarantees (|d| in [2^-100, 2^126]). Two divisions a block instead of one a element.
// Used by the transposed kernels (transpose.cuh: a thread's two stored rows, 16 codes each) and by FlatKernel's 1x64
// runs (dequantize.cuh: 8 codes of one block).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "dequantize/args.cuh"

namespace jax_fp4 {
namespace dequantize {

// Bits of a pair of 16-bit outputs (lo, hi) of finite values: one paired RNE conversion (cvt.rn.{bf16,f16}x2.f32).
template <typename Out>
__device__ __forceinline__ uint32_t FinitePair16(float lo, float hi) {
  static_assert(sizeof(Out) == 2, "16-bit outputs only");
  if constexpr (std::is_same<Out, __half>::value) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// lo[0] / lo[1]: the low bytes of the outputs of magnitudes 0..3 / 4..7; hi[]: their high bytes.
struct HalfTable {
  uint32_t lo[2], hi[2];
};

// The table of the 8 magnitudes' outputs given as pairs: t[i] = (magnitude 2i, magnitude 2i + 1).
__device__ __forceinline__ HalfTable HalfTableOfPairs(const uint32_t (&t)[4]) {
  return HalfTable{{__byte_perm(t[0], t[1], 0x6420u), __byte_perm(t[2], t[3], 0x6420u)},
                   {__byte_perm(t[0], t[1], 0x7531u), __byte_perm(t[2], t[3], 0x7531u)}};
}

// 1D / 2D: outputs of value(q) * m for a finite multiplier m.
template <typename Out>
__device__ __forceinline__ HalfTable MakeHalfTable(float m) {
  uint32_t t[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    constexpr float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    t[i] = FinitePair16<Out>(__fmul_rn(kMag[2 * i], m), __fmul_rn(kMag[2 * i + 1], m));
  }
  return HalfTableOfPairs(t);
}

// 1x64: outputs of value(q) * s_b / enc for a finite s_b and WindowDivisor::Safe(d.enc) (see the file comment).
// The zero magnitude gives 0 * d1: a zero with the sign of s_b, as RN(0 * s_b / enc) has.
template <typename Out>
__device__ __forceinline__ HalfTable MakeLocalHalfTable(float s_b, const WindowDivisor& d) {
  const float d1 = d.Div(s_b), d3 = d.Div(__fmul_rn(3.0f, s_b));  // 3 * s_b is exact (4 significant bits)
  const uint32_t t[4] = {FinitePair16<Out>(__fmul_rn(0.0f, d1), __fmul_rn(0.5f, d1)),
                         FinitePair16<Out>(d1, __fmul_rn(0.5f, d3)),
                         FinitePair16<Out>(__fmul_rn(2.0f, d1), d3),
                         FinitePair16<Out>(__fmul_rn(4.0f, d1), __fmul_rn(2.0f, d3))};
  return HalfTableOfPairs(t);
}

// The outputs of codes 8w .. 8w + 7 of one packed code word (code i in bits 4i .. 4i + 3), four codes per half k:
// lo[k] / hi[k] byte j = the low / high byte of code 4k + j's output (sign applied).
struct HalfBytes {
  uint32_t lo[2], hi[2];
};

__device__ __forceinline__ HalfBytes LookUp8(const HalfTable& tab, uint32_t word) {
  // Sign bits at bit 7 of each byte, codes in order: byte k of word << 4 / word has code 2k's / 2k + 1's.
  const uint32_t even = word << 4;
  const uint32_t sign[2] = {__byte_perm(even, word, 0x5140u), __byte_perm(even, word, 0x7362u)};
  HalfBytes b;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint32_t sel = (word >> (16 * k)) & 0x7777u;
    b.lo[k] = __byte_perm(tab.lo[0], tab.lo[1], sel);
    b.hi[k] = __byte_perm(tab.hi[0], tab.hi[1], sel) ^ (sign[k] & 0x80808080u);
  }
  return b;
}

// The 8 outputs of one code word as a 16-byte run (output i = code i).
__device__ __forceinline__ uint4 TableRun8(const HalfTable& tab, uint32_t word) {
  const HalfBytes b = LookUp8(tab, word);
  return make_uint4(__byte_perm(b.lo[0], b.hi[0], 0x5140u), __byte_perm(b.lo[0], b.hi[0], 0x7362u),
                    __byte_perm(b.lo[1], b.hi[1], 0x5140u), __byte_perm(b.lo[1], b.hi[1], 0x7362u));
}

}  // namespace dequantize
}  // namespace jax_fp4
