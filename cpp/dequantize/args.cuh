// The dequantize kernels' launch arguments and the pieces every dequantize kernel shares (docs/numerics.md s1-3):
// option bits, tile constants, the scale index (compact or GEMM-swizzled) and the inverse RHT of one 16-chunk.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/convert.cuh"
#include "common/ffi_codes.h"
#include "common/scale_layout.cuh"

namespace jax_fp4 {
namespace dequantize {

// The jf4_dequantize flags (common/ffi_codes.h) under the kernels' short names. kBlockOnly (set by the handler when an
// NVFP4 1D/2D tensor comes without its amax): values * block scale only, the exact GEMM-emulation operand (the tensor
// scale is applied after the product).
enum Option : int {
  kRht = codes::dequantize::kRht, k1x64 = codes::dequantize::kLocal1x64, kSwizzled = codes::dequantize::kSwizzled,
  kTransposeOut = codes::dequantize::kTransposeOut, kMxColumnwise = codes::dequantize::kMxColumnwise,
  kBlockOnly = codes::dequantize::kBlockOnly, kBound256 = codes::dequantize::kE4m3Max256
};

constexpr int kSeg = 16;
constexpr int kTile = 64;
constexpr int kThreads = 256;

struct Args {
  const uint8_t* data;       // [P, R, C] codes (float4: packed, even index in the low nibble)
  const uint8_t* scale;      // compact or swizzled block scales
  const float* amax;         // NVFP4 1D/2D/RHT: [1] or [P]
  const float* window_amax;  // NVFP4 1x64: [P, R, C/64]
  void* out;
  int64_t P, R, C;
  int64_t segs_per_row;       // ceil(C / 16)
  int64_t scale_cols_padded;  // columns of the swizzled scale matrix
  int flags;
  bool amax_per_p;   // amax holds P values
  bool vector_data;  // C % 16 == 0 and aligned pointers: data (and compact MX columnwise scales) as vectors
  bool vector_out;   // 16-element output runs start 16-byte aligned
  bool small;        // every flat segment index fits in 32 bits
  uint32_t c_magic;  // FlatKernel with 32-bit indices: e / C == umulhi(e, c_magic) >> c_shift for e < 2^31
  int c_shift;
};

// Sets c_magic / c_shift for C >= 2 (false for C < 2). Granlund-Montgomery: with l = ceil(log2 C), p = 31 + l and
// m = ceil(2^p / C) (< 2^32), 2^p <= m * C < 2^p + C <= 2^p + 2^(p - 31), so floor(e * m / 2^p) = floor(e / C) for
// every e < 2^31; the shift is p - 32 after the high word of the product.
inline bool SetRowDivisor(Args& a) {
  if (a.C < 2 || a.C >= (int64_t(1) << 31)) return false;
  int l = 0;
  while ((int64_t(1) << l) < a.C) ++l;
  const uint64_t p2 = uint64_t(1) << (31 + l);
  a.c_magic = uint32_t((p2 + uint64_t(a.C) - 1) / uint64_t(a.C));
  a.c_shift = l - 1;
  return true;
}

__device__ __forceinline__ int64_t ScaleIndex(const Args& a, int64_t row, int64_t col, int64_t cols) {
  return (a.flags & kSwizzled) ? layout::SwizzledIndex(row, col, a.scale_cols_padded) : row * cols + col;
}

// The ftz adds and the butterfly are shared with the forward transform (common/convert.cuh).
using cvt::AddFtz;
using cvt::kRhtSignMask;
using cvt::RhtButterfly16;
using cvt::SubFtz;

// Inverse RHT of one 16-chunk in fp32 (docs/numerics.md section 1): flush, butterfly (flushed), * 0.25 (flushed), then
// the signs. The flushes ride on the ftz adds (the first stage flushes its inputs); the last step multiplies by
// -0.25 where the sign flips (RN and the flush are sign-symmetric) and flushes with an ftz add of -0 (x + -0 == x,
// -0 + -0 == -0). The product is not taken with mul.ftz: an exact product just below FLT_MIN that rounds up to
// FLT_MIN must stay FLT_MIN, which a flush decided before rounding would not guarantee.
__device__ __forceinline__ void RhtInverse16(float (&v)[16]) {
  RhtButterfly16(v);
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = AddFtz(__fmul_rn(v[i], ((kRhtSignMask >> i) & 1u) ? -0.25f : 0.25f), -0.0f);
}

// RHT chunks whose block multiplier m (value = value(q) * m) satisfies 2^-100 <= |m| <= 2^100 never meet a
// subnormal or an overflow: every nonzero value RN(q * m / 4) and every nonzero butterfly sum is a multiple of
// 2^(E - 23), E = floor(log2(|m| / 8)) >= -103, so at least 2^-126, and |sums| <= 96 |m| / 4. Then every flush of
// RhtInverse16 is a no-op and scaling by 4 commutes with each rounding, so its outputs are the butterfly of
// RN(q * (m / 4)) (m / 4 exact) with the signs of kRhtSignMask applied last (sign-symmetric rounding; a zero gets
// its sign flipped exactly as * -0.25 does). RhtScaleFree tells such chunks.
__device__ __forceinline__ bool RhtScaleFree(float m) { return fabsf(m) >= 0x1p-100f && fabsf(m) <= 0x1p100f; }


// NVFP4 1x64: x = value(q) * s_b (exact) divided by the window's S_enc, correctly rounded, without a division per
// element. With rcp = RN(1 / enc) (one division per window), q0 = RN(x * rcp), rem = x - q0 * enc (exact in
// one fma) and q1 = RN(q0 + rem * rcp) is RN(x / enc) (Markstein's theorem: rcp within half an ulp of 1 / enc, q0
// within one ulp of x / enc) as long as nothing under- or overflows. With |x| in [2^-10, 2688] (or 0), enc in
// [2^-114, 2^90] keeps q0, rem and rem * rcp normal (`Safe`); other windows and NaN block scales take __fdiv_rn.
// copysign gives x / enc's sign to a zero quotient (the fma chain would return +0 for x = -0). Checked against
// __fdiv_rn on the host for every block-value mantissa x every divisor mantissa (tools/dev/kernel_check/markstein_check.cc).
struct WindowDivisor {
  float enc, rcp;
  __device__ __forceinline__ static bool Safe(float enc) { return enc >= 0x1p-114f && enc <= 0x1p90f; }
  __device__ __forceinline__ static WindowDivisor Of(float e) { return WindowDivisor{e, __fdiv_rn(1.0f, e)}; }
  __device__ __forceinline__ float Div(float x) const {
    const float q0 = __fmul_rn(x, rcp);
    return copysignf(__fmaf_rn(__fmaf_rn(-q0, enc, x), rcp, q0), x);
  }
};

}  // namespace dequantize
}  // namespace jax_fp4
