// The block encoders of the CPU quantize handler (quantize_cpu.h): NVFP4 1D / 2D / RHT / SR / 1x64 and MXFP8, codes
// or exact operands, compact or GEMM-swizzled scales. Bit-exact to jax_fp4.reference and to the CUDA kernels
// (cpp/quantize/quantize_parts.cuh), whose per-element helpers it calls.
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/convert.cuh"
#include "common/e2m1.cuh"
#include "common/scale_layout.cuh"
#include "cpu/parallel.h"
#include "cpu/quantize_cpu.h"
#include "dequantize/decode.cuh"
#include "quantize/four_over_six.cuh"

namespace jax_fp4 {
namespace cpu {
namespace {

// max |v[i]| over n values with NaN ignored (0 when all are NaN): the fmaxf chain of cvt::AbsMax from 0, taken on
// the bits (non-negative floats order like their bit patterns; a NaN's key is 0), so the loop vectorises.
JF4_CPU_INLINE float BlockAmax(const float* v, int n) {
  int32_t m = 0;
  for (int i = 0; i < n; ++i) {
    const uint32_t a = cvt::Bits(v[i]) & 0x7FFFFFFFu;
    const int32_t key = a > 0x7F800000u ? 0 : int32_t(a);
    m = key > m ? key : m;
  }
  return cvt::Float(uint32_t(m));
}
float Max16(const float* v) { return BlockAmax(v, 16); }

int64_t ScaleIndex(const Orientation& o, int64_t row, int64_t j, int64_t cols) {
  return o.swizzled ? layout::SwizzledIndex(row, j, o.cols_padded) : row * cols + j;
}

// Index of element (p, r, c) in the stochastic-rounding stream (Args::stream_row of quantize_parts.cuh).
int64_t StreamIndex(const Orientation& o, int64_t p, int64_t r, int64_t c) {
  if (o.stream == nullptr) return (p * o.R + r) * o.C + c;
  const uint32_t* g = o.stream;
  return ((p + g[0]) * int64_t(g[4]) + r + g[1]) * int64_t(g[5]) + c + g[2];
}

// One NVFP4 1x16 block: codes (or the exact operand) of v at flat element index `flat` of the stored data.
// Round to nearest even takes the element steps of e2m1::Pack8<false> (Clamp6, MagnitudeRne, the sign of the clamped
// product) one value per iteration, so the loop vectorises; stochastic rounding goes through Pack8<true> itself.
JF4_CPU_INLINE void PutNvfp4(const Orientation& o, const float* v, uint32_t sc, float mult, bool sr, int64_t sr_index,
                             int64_t flat) {
  alignas(16) uint8_t code[16];  // sign << 3 | magnitude code
  if (sr) {
    const cvt::Words4 r = cvt::Philox(uint32_t(sr_index >> 4), o.key[0], o.key[1]);
    const uint32_t rnd[4] = {r.x, r.y, r.z, r.w};
    const uint32_t w[2] = {e2m1::Pack8<true>(v, mult, rnd, 0), e2m1::Pack8<true>(v + 8, mult, rnd, 8)};
    for (int i = 0; i < 16; ++i) code[i] = uint8_t((w[i >> 3] >> (4 * (i & 7))) & 0xFu);
  } else {
    for (int i = 0; i < 16; ++i) {
      const float c = e2m1::Clamp6(cvt::Mul(v[i], mult));
      code[i] = uint8_t((e2m1::MagnitudeRne(c) - e2m1::kMagic) | ((cvt::Bits(c) >> 31) << 3));
    }
  }
  if (!o.exact) {
    uint8_t* __restrict out = o.data + flat / 2;  // even index in the low nibble
    for (int t = 0; t < 8; ++t) out[t] = uint8_t(code[2 * t] | (code[2 * t + 1] << 4));
    return;
  }
  // The exact operand: bfloat16 of value(code) * s_b.
  const float s_b = cvt::E4M3Value(sc);
  uint16_t* __restrict out = reinterpret_cast<uint16_t*>(o.data) + flat;
  for (int i = 0; i < 16; ++i) out[i] = uint16_t(cvt::Bf16Rne(cvt::Mul(dequantize::E2M1Value(code[i]), s_b)));
}

// A 4over6 candidate's packed codes (or its exact operand) and its scale code at block j of oriented row `row`.
void Put4over6(const Orientation& o, const four_over_six::Candidate& c, int64_t row, int64_t j, int64_t flat) {
  o.scale[ScaleIndex(o, row, j, o.C / 16)] = uint8_t(c.sc);
  if (!o.exact) {
    uint8_t* out = o.data + flat / 2;  // Pack8's words, little-endian: element 2j in the low nibble of byte j
    for (int t = 0; t < 8; ++t) out[t] = uint8_t(c.w[t >> 2] >> (8 * (t & 3)));
    return;
  }
  const float s_b = cvt::E4M3Value(c.sc);
  uint16_t* out = reinterpret_cast<uint16_t*>(o.data) + flat;
  for (int i = 0; i < 16; ++i) {
    out[i] = uint16_t(cvt::Bf16Rne(cvt::Mul(dequantize::E2M1Value((c.w[i >> 3] >> (4 * (i & 7))) & 0xFu), s_b)));
  }
}

// NVFP4 4over6 (four_over_six.cuh): both candidates of every block, then the choice per block, or per 16x16 tile
// from the 16 rows' errors in TE's tree order (2D: the band is one tile high).
void Encode4over6Band(const Orientation& o, int64_t p, int64_t r0, int rows, const float* buf) {
  const int64_t C = o.C, nb = C / 16;
  const bool two_d = o.opts & k2d, mse = o.opts & kMse;
  const float amax = o.amax[p], bound = E4m3Bound(o.opts);
  const float enc = four_over_six::GlobalEncodeScale(amax, bound);
  std::vector<float> tile_amax(two_d ? nb : 0, 0.0f);
  for (int t = 0; two_d && t < rows; ++t) {
    for (int64_t j = 0; j < nb; ++j) tile_amax[j] = cvt::AbsMax(tile_amax[j], Max16(buf + t * C + 16 * j));
  }
  std::vector<four_over_six::Pair> cand(size_t(rows) * nb);
  for (int i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < nb; ++j) {
      float v[16];
      std::memcpy(v, buf + i * C + 16 * j, sizeof(v));
      cand[i * nb + j] = four_over_six::Candidates(v, two_d ? tile_amax[j] : Max16(v), amax, enc, bound, mse);
    }
  }
  for (int64_t j = 0; j < nb; ++j) {
    bool tile_pick4 = false;
    if (two_d) {
      float e4[16], e6[16];
      for (int i = 0; i < 16; ++i) e4[i] = cand[i * nb + j].c[0].err, e6[i] = cand[i * nb + j].c[1].err;
      tile_pick4 = four_over_six::PickMap4(four_over_six::TileSum(e4), four_over_six::TileSum(e6));
    }
    for (int i = 0; i < rows; ++i) {
      const four_over_six::Pair& c = cand[i * nb + j];
      const bool pick4 = two_d ? tile_pick4 : four_over_six::PickMap4(c.c[0].err, c.c[1].err);
      const int64_t row = p * o.R + r0 + i;
      Put4over6(o, c.c[pick4 ? 0 : 1], row, j, row * C + 16 * j);
    }
  }
}

JF4_CPU_CLONES void EncodeNvfp4Band(const Orientation& o, int64_t p, int64_t r0, int rows, const float* buf) {
  if (o.opts & k4over6) return Encode4over6Band(o, p, r0, rows, buf);
  const int64_t C = o.C, nb = C / 16;
  const bool local = o.opts & k1x64, sr = (o.opts & kSr) && !local, two_d = o.opts & k2d;
  const float enc = local ? 1.0f : cvt::GlobalEncodeScale(o.amax[p]);
  const float enc6 = cvt::Mul(enc, cvt::kInv6());
  std::vector<float> tile_amax;  // 2D: the 16x16 tiles' amax (the band is one tile high)
  if (two_d) {
    tile_amax.assign(nb, 0.0f);
    for (int t = 0; t < rows; ++t) {
      for (int64_t j = 0; j < nb; ++j) tile_amax[j] = cvt::AbsMax(tile_amax[j], Max16(buf + t * C + 16 * j));
    }
  }
  for (int i = 0; i < rows; ++i) {
    const int64_t r = r0 + i, row = p * o.R + r;
    const float* v = buf + i * C;
    for (int64_t j = 0; j < nb; ++j) {
      const float bamax = two_d ? tile_amax[j] : Max16(v + 16 * j);
      float enc_b = enc, enc6_b = enc6;
      if (local && (j & 3) == 0) {  // a new 1x64 window
        const float wa = cvt::AbsMax(cvt::AbsMax(cvt::AbsMax(Max16(v + 16 * j), Max16(v + 16 * j + 16)),
                                                 Max16(v + 16 * j + 32)), Max16(v + 16 * j + 48));
        o.wamax[row * (C / 64) + j / 4] = wa;
      }
      if (local) {
        enc_b = cvt::WindowEncodeScale(o.wamax[row * (C / 64) + j / 4]);
        enc6_b = cvt::Mul(enc_b, cvt::kInv6());
      }
      const uint32_t sc = cvt::E4M3(cvt::Mul(bamax, enc6_b));
      float mult;
      if (local) {
        const float s_b = cvt::E4M3Value(sc);
        mult = s_b == 0.0f ? 0.0f : cvt::Div(enc_b, s_b);
      } else {
        const float m = cvt::Rcp(cvt::Mul(cvt::E4M3Value(sc), cvt::Rcp(enc)));
        mult = m > FLT_MAX ? FLT_MAX : m;
      }
      PutNvfp4(o, v + 16 * j, sc, mult, sr, sr ? StreamIndex(o, p, r, 16 * j) : 0, row * C + 16 * j);
      o.scale[ScaleIndex(o, row, j, nb)] = uint8_t(sc);
    }
  }
}

// E4M3 / E5M2 code of v (RNE, satfinite, NaN -> 0x7F): the host path of cvt::E4M3x2 / cvt::E5M2x2, per value.
template <bool kE4m3>
JF4_CPU_INLINE uint32_t Fp8Code(float v) {
  return kE4m3 ? cvt::SmallFloatRne<3, 7, 0x7Eu>(v) : cvt::SmallFloatRne<2, 15, 0x7Bu>(v);
}

// The exact operand's value of code q with scale s: bfloat16 operands saturate to its range (dequantize::MxDecode).
template <bool kE4m3>
JF4_CPU_INLINE float ExactValue(uint32_t q, float s) {
  return kE4m3 ? dequantize::MxDecode<dequantize::kMxfp8E4m3>(q, s, dequantize::kBf16MaxBits)
               : dequantize::MxDecode<dequantize::kMxfp8E5m2>(q, s, dequantize::kBf16MaxBits);
}

// One 32-block: codes q[k] = fp8(b[k] * mult) and, when exact, the bfloat16 bits of ExactValue(q[k], s).
template <bool kE4m3, bool kExact>
JF4_CPU_INLINE void Mxfp8Block(const float* __restrict b, float mult, float s, uint8_t* __restrict q,
                               uint16_t* __restrict ex) {
  for (int k = 0; k < 32; ++k) q[k] = uint8_t(Fp8Code<kE4m3>(cvt::Mul(b[k], mult)));
  if (!kExact) return;
  for (int k = 0; k < 32; ++k) ex[k] = uint16_t(cvt::Bf16Rne(ExactValue<kE4m3>(q[k], s)));
}

// Each row of the band is blocks of 32 along C. Rowwise they are encoded straight into the output rows; columnwise
// (the band is 16 columns of x[p], as the grouped handler passes it) into a band buffer transposed into x's [P, M, K]
// layout afterwards (jf4_quantize takes EncodeMxfp8Stripe instead, without transposes).
template <bool kE4m3, bool kExact>
JF4_CPU_CLONES void EncodeMxfp8RowsT(const Orientation& o, int64_t p, int64_t r0, int rows, const float* buf) {
  const int64_t C = o.C, nb = C / 32, M = o.col ? o.C : o.R, K = o.col ? o.R : o.C;
  const float inv = kE4m3 ? cvt::kInv448() : cvt::kInv57344();
  std::vector<uint8_t> codes_band(o.col ? size_t(rows) * C : 0);
  std::vector<uint16_t> exact_band(o.col && kExact ? size_t(rows) * C : 0);
  uint8_t codes[32];
  for (int i = 0; i < rows; ++i) {
    const int64_t r = r0 + i, row = p * o.R + r;
    const float* v = buf + i * C;
    uint8_t* q = o.col ? codes_band.data() + i * C : kExact ? nullptr : o.data + row * C;
    uint16_t* ex = !kExact ? nullptr
                   : o.col ? exact_band.data() + i * C
                           : reinterpret_cast<uint16_t*>(o.data) + row * C;
    for (int64_t j = 0; j < nb; ++j) {
      const uint32_t e = cvt::E8M0FromFloat(cvt::Mul(BlockAmax(v + 32 * j, 32), inv));
      Mxfp8Block<kE4m3, kExact>(v + 32 * j, cvt::E8M0InverseScale(e), dequantize::E8M0Value(e),
                                q ? q + 32 * j : codes, kExact ? ex + 32 * j : nullptr);
      const int64_t idx = !o.col ? ScaleIndex(o, row, j, nb)
                          : o.swizzled ? layout::SwizzledIndex(p * K + r, j, o.cols_padded) : (p * nb + j) * K + r;
      o.scale[idx] = uint8_t(e);
    }
  }
  if (!o.col) return;
  for (int64_t c = 0; c < C; ++c) {  // element c of column r is x[p, c, r]
    const int64_t flat = (p * M + c) * K + r0;
    for (int i = 0; i < rows; ++i) {
      if (kExact) reinterpret_cast<uint16_t*>(o.data)[flat + i] = exact_band[i * C + c];
      else o.data[flat + i] = codes_band[i * C + c];
    }
  }
}

// Columnwise: the 32 rows m0..m0+31 of x[p] (buf[32][K]) hold one block per column k, encoded in x's layout
// (element m of column k is x[p, m, k]): column amaxes, scales and codes all run along k, no transposes.
template <bool kE4m3, bool kExact>
JF4_CPU_CLONES void EncodeMxfp8StripeT(const Orientation& o, int64_t p, int64_t m0, const float* buf) {
  const int64_t K = o.R, M = o.C, nb = M / 32, j = m0 / 32;
  const float inv = kE4m3 ? cvt::kInv448() : cvt::kInv57344();
  std::vector<float> amax(K, 0.0f), mult(K), s(K);
  for (int i = 0; i < 32; ++i) {
    for (int64_t k = 0; k < K; ++k) {  // cvt::AbsMax's NaN-ignoring max, on the bits as in BlockAmax
      const uint32_t a = cvt::Bits(buf[i * K + k]) & 0x7FFFFFFFu;
      const int32_t key = a > 0x7F800000u ? 0 : int32_t(a), cur = int32_t(cvt::Bits(amax[k]));
      amax[k] = cvt::Float(uint32_t(key > cur ? key : cur));
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    const uint32_t e = cvt::E8M0FromFloat(cvt::Mul(amax[k], inv));
    mult[k] = cvt::E8M0InverseScale(e), s[k] = dequantize::E8M0Value(e);
    const int64_t idx = o.swizzled ? layout::SwizzledIndex(p * K + k, j, o.cols_padded) : (p * nb + j) * K + k;
    o.scale[idx] = uint8_t(e);
  }
  const float* __restrict mu = mult.data();
  const float* __restrict sc = s.data();
  for (int i = 0; i < 32; ++i) {
    const int64_t flat = (p * M + m0 + i) * K;
    const float* __restrict v = buf + i * K;
    uint8_t* __restrict codes = o.data + flat;  // local restrict pointers: a byte store may alias anything
    uint16_t* __restrict ex = reinterpret_cast<uint16_t*>(o.data) + flat;
    for (int64_t k = 0; k < K; ++k) {
      const uint32_t q = Fp8Code<kE4m3>(cvt::Mul(v[k], mu[k]));
      if (!kExact) {
        codes[k] = uint8_t(q);
        continue;
      }
      ex[k] = uint16_t(cvt::Bf16Rne(ExactValue<kE4m3>(q, sc[k])));
    }
  }
}

}  // namespace

void EncodeMxfp8Stripe(const Orientation& o, int64_t p, int64_t m0, const float* buf) {
  const bool e4m3 = o.kind == kMxfp8E4m3;
  if (e4m3 && o.exact) EncodeMxfp8StripeT<true, true>(o, p, m0, buf);
  else if (e4m3) EncodeMxfp8StripeT<true, false>(o, p, m0, buf);
  else if (o.exact) EncodeMxfp8StripeT<false, true>(o, p, m0, buf);
  else EncodeMxfp8StripeT<false, false>(o, p, m0, buf);
}

namespace {

void EncodeMxfp8Rows(const Orientation& o, int64_t p, int64_t r0, int rows, const float* buf) {
  const bool e4m3 = o.kind == kMxfp8E4m3;
  if (e4m3 && o.exact) EncodeMxfp8RowsT<true, true>(o, p, r0, rows, buf);
  else if (e4m3) EncodeMxfp8RowsT<true, false>(o, p, r0, rows, buf);
  else if (o.exact) EncodeMxfp8RowsT<false, true>(o, p, r0, rows, buf);
  else EncodeMxfp8RowsT<false, false>(o, p, r0, rows, buf);
}

}  // namespace

void EncodeBand(const Orientation& o, int64_t p, int64_t r0, int rows, float* buf) {
  if (o.kind == kNvfp4) {
    if (o.opts & kRht) {
      for (int i = 0; i < rows; ++i) {
        for (int64_t c = 0; c < o.C; c += 16) cvt::RhtForward16(*reinterpret_cast<float(*)[16]>(buf + i * o.C + c));
      }
    }
    EncodeNvfp4Band(o, p, r0, rows, buf);
  } else {
    EncodeMxfp8Rows(o, p, r0, rows, buf);
  }
}

}  // namespace cpu
}  // namespace jax_fp4
