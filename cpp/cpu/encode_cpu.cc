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
#include "cpu/quantize_cpu.h"
#include "dequantize/decode.cuh"

namespace jax_fp4 {
namespace cpu {
namespace {

float Max16(const float* v) {
  float m = 0.0f;
  for (int i = 0; i < 16; ++i) m = cvt::AbsMax(m, v[i]);
  return m;
}

int64_t ScaleIndex(const Orientation& o, int64_t row, int64_t j, int64_t cols) {
  return o.swizzled ? layout::SwizzledIndex(row, j, o.cols_padded) : row * cols + j;
}

// Index of element (p, r, c) in the stochastic-rounding stream (Args::stream_row of quantize_parts.cuh).
int64_t StreamIndex(const Orientation& o, int64_t p, int64_t r, int64_t c) {
  if (o.stream == nullptr) return (p * o.R + r) * o.C + c;
  const uint32_t* g = o.stream;
  return ((p + g[0]) * int64_t(g[4]) + r + g[1]) * int64_t(g[5]) + c + g[2];
}

void StoreBf16(uint8_t* dst, const float* v, int n) {
  for (int i = 0; i < n; ++i) {
    const uint16_t b = uint16_t(cvt::Bf16Rne(v[i]));
    std::memcpy(dst + 2 * i, &b, 2);
  }
}

// One NVFP4 1x16 block: codes (or the exact operand) of v at flat element index `flat` of the stored data.
void PutNvfp4(const Orientation& o, const float* v, uint32_t sc, float mult, bool sr, int64_t sr_index, int64_t flat) {
  uint32_t rnd[4] = {0u, 0u, 0u, 0u};
  uint32_t w[2];
  if (sr) {
    const cvt::Words4 r = cvt::Philox(uint32_t(sr_index >> 4), o.key[0], o.key[1]);
    rnd[0] = r.x, rnd[1] = r.y, rnd[2] = r.z, rnd[3] = r.w;
    w[0] = e2m1::Pack8<true>(v, mult, rnd, 0);
    w[1] = e2m1::Pack8<true>(v + 8, mult, rnd, 8);
  } else {
    w[0] = e2m1::Pack8<false>(v, mult, rnd, 0);
    w[1] = e2m1::Pack8<false>(v + 8, mult, rnd, 8);
  }
  if (!o.exact) {
    std::memcpy(o.data + flat / 2, w, 8);
    return;
  }
  const float s_b = cvt::E4M3Value(sc);
  float q[16];
  for (int i = 0; i < 16; ++i) q[i] = cvt::Mul(dequantize::E2M1Value((w[i >> 3] >> (4 * (i & 7))) & 0xFu), s_b);
  StoreBf16(o.data + 2 * flat, q, 16);
}

void EncodeNvfp4Band(const Orientation& o, int64_t p, int64_t r0, int rows, const float* buf) {
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

void EncodeMxfp8Band(const Orientation& o, int64_t p, int64_t r0, int rows, const float* buf) {
  const int64_t C = o.C, nb = C / 32, M = o.col ? o.C : o.R, K = o.col ? o.R : o.C;
  const bool e4m3 = o.kind == kMxfp8E4m3;
  for (int i = 0; i < rows; ++i) {
    const int64_t r = r0 + i;
    const float* v = buf + i * C;
    for (int64_t j = 0; j < nb; ++j) {
      const float* b = v + 32 * j;
      const float bamax = cvt::AbsMax(Max16(b), Max16(b + 16));
      const uint32_t e = cvt::E8M0FromFloat(cvt::Mul(bamax, e4m3 ? cvt::kInv448() : cvt::kInv57344()));
      const float mult = cvt::E8M0InverseScale(e);
      uint8_t q[32];
      for (int k = 0; k < 32; k += 2) {
        const float a = cvt::Mul(b[k], mult), c = cvt::Mul(b[k + 1], mult);
        const uint32_t pair = e4m3 ? cvt::E4M3x2(a, c) : cvt::E5M2x2(a, c);
        q[k] = uint8_t(pair), q[k + 1] = uint8_t(pair >> 8);
      }
      float ex[32];
      if (o.exact) {
        const float s = dequantize::E8M0Value(e);
        for (int k = 0; k < 32; ++k) {  // bfloat16 operands: saturated to its range (dequantize::MxDecode)
          ex[k] = e4m3 ? dequantize::MxDecode<dequantize::kMxfp8E4m3>(q[k], s, dequantize::kBf16MaxBits)
                       : dequantize::MxDecode<dequantize::kMxfp8E5m2>(q[k], s, dequantize::kBf16MaxBits);
        }
      }
      if (!o.col) {
        const int64_t flat = (p * M + r) * K + 32 * j;
        if (o.exact) StoreBf16(o.data + 2 * flat, ex, 32);
        else std::memcpy(o.data + flat, q, 32);
        o.scale[ScaleIndex(o, p * M + r, j, nb)] = uint8_t(e);
      } else {  // data keeps x's [P, M, K] layout: element c of column r is x[p, c, r]
        for (int k = 0; k < 32; ++k) {
          const int64_t flat = (p * M + 32 * j + k) * K + r;
          if (o.exact) StoreBf16(o.data + 2 * flat, ex + k, 1);
          else o.data[flat] = q[k];
        }
        const int64_t idx = o.swizzled ? layout::SwizzledIndex(p * K + r, j, o.cols_padded) : (p * nb + j) * K + r;
        o.scale[idx] = uint8_t(e);
      }
    }
  }
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
    EncodeMxfp8Band(o, p, r0, rows, buf);
  }
}

}  // namespace cpu
}  // namespace jax_fp4
