// NVFP4 "4over6" block selection (docs/numerics.md section 1, "4over6"; TE common/cast/nvfp4/
// quantize_4over6_nvfp4.cuh: compute_scale_pair, cvt_fp32_to_fp4_8x_with_error, accumulate_dequant_error): each 1x16
// block is encoded with its amax mapped to 4 (block scale x1.5) and to 6 (the plain scale), and keeps the candidate
// whose reconstruction has the smaller error (ties and NaN: map-to-6). Host and device (common/hd.h), so the CPU
// handlers and the CUDA kernels share every rounding; bit-exact to jax_fp4/reference/nvfp4_4over6.py.
#pragma once

#include <cfloat>
#include <cstdint>

#include "common/convert.cuh"
#include "common/e2m1.cuh"
#include "common/hd.h"
#include "dequantize/decode.cuh"

namespace jax_fp4 {
namespace four_over_six {

// fp32 IEEE sum (device: no FMA contraction, subnormals kept; host: -ffp-contract=off, FTZ / DAZ cleared).
JF4_HD float Add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// S_enc = min(6 * e4m3_max / amax, FLT_MAX); 1 when amax == 0 or S_enc == 0 (TE core_nvfp4.cuh
// compute_global_encode_scaling_factor_FP4<E4M3_MAX>). e4m3_max = 448 is cvt::GlobalEncodeScale.
JF4_HD float GlobalEncodeScale(float amax, float e4m3_max) {
  if (amax == 0.0f) return 1.0f;
  const float q = cvt::Div(6.0f * e4m3_max, amax);  // 1536 or 2688: exact
  const float s = q > FLT_MAX ? FLT_MAX : q;  // q is never NaN for an amax (>= 0, NaN-free)
  return s == 0.0f ? 1.0f : s;
}

// The element multiplier of a candidate scale code: min(1 / (s_b * (1 / enc)), FLT_MAX) (quantize_parts.cuh
// Nvfp4Multiplier, TE's inv_map4 / inv_map6).
JF4_HD float Multiplier(uint32_t sc, float enc) {
  const float m = cvt::Rcp(cvt::Mul(cvt::E4M3Value(sc), cvt::Rcp(enc)));
  return m > FLT_MAX ? FLT_MAX : m;
}

// One candidate of a block: 16 codes packed 8 per word (element 2j in nibble j of its word's byte order, as
// e2m1::Pack8), its E4M3 scale code and its error.
struct Candidate {
  uint32_t w[2];
  uint32_t sc;
  float err;
};

struct Pair {
  Candidate c[2];  // [0] map-to-4, [1] map-to-6
};

// The two candidates of the block v[16] with block (or 16x16 tile) amax `bamax`, tensor amax `amax` and its encode
// scale `enc` (GlobalEncodeScale(amax, e4m3_max)); `mse`: squared instead of absolute differences.
// sc6 = e4m3(base), sc4 = e4m3(base * 1.5), base = (bamax / 6) * enc; codes q = e2m1(x * Multiplier(sc));
// err = sum over i = 0..15 from +0 of |((value(q_i) * s_b) * amax) / (6 * e4m3_max) - x_i| (or its square).
JF4_HD Pair Candidates(const float (&v)[16], float bamax, float amax, float enc, float e4m3_max, bool mse) {
  const float base = cvt::Mul(cvt::Div(bamax, 6.0f), enc);
  const float denom = 6.0f * e4m3_max;
  Pair p;
  const uint32_t rnd[4] = {0u, 0u, 0u, 0u};
  for (int c = 0; c < 2; ++c) {
    const uint32_t sc = cvt::E4M3(c == 0 ? cvt::Mul(base, 1.5f) : base);  // base >= 0, never NaN: = TE's fminf + cast
    const float mult = Multiplier(sc, enc), s_b = cvt::E4M3Value(sc);
    p.c[c].sc = sc;
    p.c[c].w[0] = e2m1::Pack8<false>(v, mult, rnd, 0);
    p.c[c].w[1] = e2m1::Pack8<false>(v + 8, mult, rnd, 8);
    float err = 0.0f;
    JF4_UNROLL
    for (int i = 0; i < 16; ++i) {
      const float q = dequantize::E2M1Value((p.c[c].w[i >> 3] >> (4 * (i & 7))) & 0xFu);
      const float d = Add(cvt::Div(cvt::Mul(cvt::Mul(q, s_b), amax), denom), -v[i]);
      err = Add(err, mse ? cvt::Mul(d, d) : fabsf(d));
    }
    p.c[c].err = err;
  }
  return p;
}

// The 16 rows' (columns') errors e[0..15] of a 16x16 tile summed in TE's warp-tree order (reduce_group_sum_16:
// e_i + e_{i+8}, then 4, 2 and 1 apart).
JF4_HD float TileSum(const float (&e)[16]) {
  float a[8];
  JF4_UNROLL
  for (int i = 0; i < 8; ++i) a[i] = Add(e[i], e[i + 8]);
  JF4_UNROLL
  for (int i = 0; i < 4; ++i) a[i] = Add(a[i], a[i + 4]);
  JF4_UNROLL
  for (int i = 0; i < 2; ++i) a[i] = Add(a[i], a[i + 2]);
  return Add(a[0], a[1]);
}

// Whether map-to-4 wins: err4 < err6 (false on ties and NaN).
JF4_HD bool PickMap4(float err4, float err6) { return err4 < err6; }

}  // namespace four_over_six
}  // namespace jax_fp4
