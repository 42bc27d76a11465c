// Building blocks of the quantize kernels (quantize.cuh, grouped/grouped_quantize.cuh):
// the kernel arguments, per-segment encoders and the rowwise / columnwise steps of one 64x64 tile
// (docs/numerics.md s1-3). A "segment" is 16 consecutive elements of a row (rowwise) or of a column (columnwise) of
// one tile, held by one thread in registers as fp32.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/convert.cuh"
#include "common/e2m1.cuh"
#include "dequantize/decode.cuh"
#include "quantize/four_over_six.cuh"
#include "quantize/options.h"

namespace jax_fp4 {
namespace quantize {

constexpr int kTile = 64;
constexpr int kThreads = 256;

struct Args {
  const void* x;
  int64_t P, M, K;
  const float* amax_row;  // [P]
  const float* amax_col;  // [P]
  const uint32_t* key_row;  // [2]
  const uint32_t* key_col;  // [2]
  uint8_t* row_data;
  uint8_t* row_scale;
  float* row_wamax;
  uint8_t* col_data;
  uint8_t* col_scale;
  float* col_wamax;
  float* dbias;  // [P, ceil(M/64), K] partial column sums, or null
  int row_opts, col_opts;
  bool swizzled;
  bool vector_loads;  // rows are 16-byte aligned (K * sizeof(In) % 16 == 0 and x aligned)
  int64_t row_scale_cols_padded, col_scale_cols_padded;  // padded scale-matrix columns (swizzled layout)
  int tiles_per_cta;  // 64-row tiles one thread block walks down (set by Launch)
  // Stochastic-rounding stream of a shard (reference/sr.py). The element at index i of the *global* stored data
  // takes byte i % 16 of Philox(i / 16). Null (the zero value, e.g. `Args a{}`): this call's data is the whole
  // tensor, i = the local flat index. Otherwise uint32[6] on the device, in stored order (rowwise [P, M, K],
  // columnwise [P, K, M]): (p_off, r_off, c_off, P_tot, R_tot, C_tot), the shard's offsets in the global stored
  // data and its global dims, so i = ((p + p_off) * R_tot + r + r_off) * C_tot + c + c_off (P_tot is unused). The
  // jf4_quantize handler points them at words 2..7 of an 8-word key operand (the Philox key is words 0..1). Needs
  // C_tot % 16 == 0 and c_off % 16 == 0 (shards hold whole 16-blocks, which the sharding rule guarantees), so every
  // 16-block starts at i % 16 == 0 and is one whole Philox output.
  const uint32_t* stream_row = nullptr;
  const uint32_t* stream_col = nullptr;
  // Exact GEMM-emulation operand instead of codes (NVFP4 except 1x64, MXFP8): that orientation's data buffer holds
  // bfloat16 value(q) * block scale (the tensor scale left out) in the stored layout, bit for bit the dequantize
  // kernel's block-scales-only / MXFP8-to-bf16 output of the codes this call would have written. Read only by the
  // kExact kernels (Launch picks them), so the code-writing kernels carry none of it.
  bool row_exact = false;
  bool col_exact = false;
};

// Input element -> fp32 (exact widening).
template <typename In>
__device__ __forceinline__ float ToFloat(In v);
template <>
__device__ __forceinline__ float ToFloat<float>(float v) { return v; }
template <>
__device__ __forceinline__ float ToFloat<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float ToFloat<__half>(__half v) { return __half2float(v); }

// A thread's 16-element row segment as raw 16-byte words (sizeof(In) of them), so that it can be loaded ahead of its
// tile (QuantizeKernel prefetches the next tile's segment while it works on the current one).
template <typename In>
struct RawSegment {
  uint4 w[sizeof(In)];
};

template <typename In>
__device__ __forceinline__ void LoadRaw(const In* src, RawSegment<In>& r) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int q = 0; q < int(sizeof(In)); ++q) r.w[q] = __ldg(s + q);
}

// Raw segment -> 16 fp32 values (exact widening).
template <typename In>
__device__ __forceinline__ void Widen16(const RawSegment<In>& r, float (&v)[16]) {
  constexpr int kPerVec = 16 / sizeof(In);
#pragma unroll
  for (int q = 0; q < 16 / kPerVec; ++q) {
    const uint4 w = r.w[q];
    if constexpr (std::is_same<In, __nv_bfloat16>::value) {  // bf16 -> fp32 is a shift: one instruction a value
      const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[q * 8 + 2 * i] = __uint_as_float(ws[i] << 16);
        v[q * 8 + 2 * i + 1] = __uint_as_float(ws[i] & 0xFFFF0000u);
      }
    } else {
      const In* e = reinterpret_cast<const In*>(&w);
#pragma unroll
      for (int i = 0; i < kPerVec; ++i) v[q * kPerVec + i] = ToFloat<In>(e[i]);
    }
  }
}

// Loads 16 consecutive elements (vectorised when aligned); elements past `valid` read as 0.
template <typename In>
__device__ __forceinline__ void Load16(const In* src, int valid, bool vector, float (&v)[16]) {
  if (vector && valid >= 16) {
    RawSegment<In> r;
    LoadRaw<In>(src, r);
    Widen16<In>(r, v);
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = i < valid ? ToFloat<In>(src[i]) : 0.0f;
  }
}

// Flat byte index of S[i, j] in the GEMM-swizzled padded scale matrix with `cols_padded` columns.
__device__ __forceinline__ int64_t SwizzledIndex(int64_t i, int64_t j, int64_t cols_padded) {
  return ((i >> 7) * (cols_padded >> 2) + (j >> 2)) * 512 + (i & 31) * 16 + ((i & 127) >> 5) * 4 + (j & 3);
}

__device__ __forceinline__ float Max16(const float (&v)[16]) {
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) m = cvt::AbsMax(m, v[i]);
  return m;
}

// ---- exact operands (Args::row_exact / col_exact): the same decode and rounding as dequantize/decode.cuh ----------
__device__ __forceinline__ uint32_t Bf16Pair(float lo, float hi) {
  return dequantize::OutBits<__nv_bfloat16>(lo) | (dequantize::OutBits<__nv_bfloat16>(hi) << 16);
}

// w[j] for a run-time j < N through compare-selects. Indexing a register array with a run-time value puts the whole
// array in local memory, and ptxas stores it there ahead of the branch that needs it, i.e. on the vector path too
// (the MXFP8-columnwise kernels paid a 16-byte local store per thread and tile for their rare byte-store loop).
template <int N>
__device__ __forceinline__ uint32_t PickWord(const uint32_t (&w)[N], int j) {
  uint32_t r = w[0];
#pragma unroll
  for (int i = 1; i < N; ++i) r = j == i ? w[i] : r;
  return r;
}

// 16 bfloat16 (8 words) to dst: two 16-byte stores when `vector` (dst 16-byte aligned) and the run is whole, else
// the first `valid` elements one by one.
__device__ __forceinline__ void StoreBf16x16(uint8_t* dst, const uint32_t (&o)[8], int valid, bool vector) {
  if (vector && valid == 16) {
    uint4* d = reinterpret_cast<uint4*>(dst);
    d[0] = make_uint4(o[0], o[1], o[2], o[3]);
    d[1] = make_uint4(o[4], o[5], o[6], o[7]);
    return;
  }
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  for (int i = 0; i < valid; ++i) d[i] = uint16_t(PickWord(o, i >> 1) >> (16 * (i & 1)));
}

// value(q) * s_b of one NVFP4 block (packed codes w, E4M3 scale code sc) as 16 bfloat16 at dst (32-byte aligned).
__device__ __forceinline__ void StoreExactNvfp4(uint2 w, uint32_t sc, uint8_t* dst) {
  const float s_b = cvt::E4M3Value(sc);
  float q[2][8];
  dequantize::E2M1xN<8>(w.x, q[0]);
  dequantize::E2M1xN<8>(w.y, q[1]);
  uint32_t o[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    o[i] = Bf16Pair(__fmul_rn(q[i >> 2][(2 * i) & 7], s_b), __fmul_rn(q[i >> 2][(2 * i + 1) & 7], s_b));
  }
  StoreBf16x16(dst, o, 16, true);
}

// float(q) * scale of 16 MXFP8 codes (4 per word of `out`), saturated to the bfloat16 range (MxDecode); scale[i] is
// element i's E8M0 value.
template <int kKind>
__device__ __forceinline__ void ExactMxfp8(const uint32_t (&out)[4], const float (&scale)[16], uint32_t (&o)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t w = out[i >> 1] >> (16 * (i & 1));
    o[i] = Bf16Pair(dequantize::MxDecode<kKind>(w & 0xFFu, scale[2 * i], dequantize::kBf16MaxBits),
                    dequantize::MxDecode<kKind>((w >> 8) & 0xFFu, scale[2 * i + 1], dequantize::kBf16MaxBits));
  }
}

// ExactMxfp8 of 16 codes of one 32-block (E8M0 scale code e).
template <int kKind>
__device__ __forceinline__ void ExactMxfp8Block(const uint32_t (&out)[4], uint32_t e, uint32_t (&o)[8]) {
  const float s = dequantize::E8M0Value(e);
  const float scale[16] = {s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s};
  ExactMxfp8<kKind>(out, scale, o);
}

// NVFP4 encode of one 1x16 block with its (block / 2D-tile) amax. `enc` is S_enc (1D/2D) or S_enc,w (1x64).
// Writes 8 packed bytes to dst (8-byte aligned), or with `exact` the 16 bfloat16 of StoreExactNvfp4 (32-byte
// aligned), and returns the E4M3 scale code. kSr: stochastic rounding with the 16 random bytes `rnd` (one Philox
// output).
// The element multiplier of a block with E4M3 scale code sc under tensor encode scale enc (1D / 2D):
// min(1 / (s_b * (1 / enc)), FLT_MAX), s_b the value of sc. MultiplierTable precomputes it for all 127 codes a
// quantizer can produce (satfinite: 0..0x7E), which replaces two correctly rounded reciprocals per block with a
// shared-memory load.
__device__ __forceinline__ float Nvfp4Multiplier(uint32_t sc, float enc) {
  return fminf(__frcp_rn(__fmul_rn(cvt::E4M3Value(sc), __frcp_rn(enc))), FLT_MAX);
}

// tab[i] = Nvfp4Multiplier(i, enc) for i < 128, written by threads [t0, t0 + 128) of the block (no barrier here).
__device__ __forceinline__ void MultiplierTable(float* tab, float enc, int t0) {
  const int i = int(threadIdx.x) - t0;
  if (i >= 0 && i < 128) tab[i] = Nvfp4Multiplier(uint32_t(i), enc);
}

// `tab`: MultiplierTable of enc, or null (computed here). Unused for 1x64 (local) encodes.
template <bool kSr>
__device__ __forceinline__ uint32_t EncodeNvfp4(const float (&v)[16], float bamax, float enc, bool local,
                                                 const float* tab, const uint32_t (&rnd)[4], uint8_t* dst,
                                                 bool exact) {
  const uint32_t sc = cvt::E4M3(__fmul_rn(bamax, __fmul_rn(enc, cvt::kInv6())));
  float mult;
  if (local) {
    const float s_b = cvt::E4M3Value(sc);
    mult = s_b == 0.0f ? 0.0f : __fdiv_rn(enc, s_b);
  } else if (tab != nullptr) {
    mult = tab[sc];
  } else {
    mult = Nvfp4Multiplier(sc, enc);
  }
  const uint2 w = make_uint2(e2m1::Pack8<kSr>(v, mult, rnd, 0), e2m1::Pack8<kSr>(v + 8, mult, rnd, 8));
  if (exact) {
    StoreExactNvfp4(w, sc, dst);
  } else {
    *reinterpret_cast<uint2*>(dst) = w;
  }
  return sc;
}

// Index in the stochastic-rounding stream of element (p, r, c) of a stored [P, R, C] array whose local flat index is
// `flat` (see Args::stream_row). Read only when SR is on.
__device__ __forceinline__ int64_t StreamIndex(const uint32_t* g, int64_t flat, int64_t p, int64_t r, int64_t c) {
  if (g == nullptr) return flat;
  return ((p + __ldg(g)) * int64_t(__ldg(g + 4)) + r + __ldg(g + 1)) * int64_t(__ldg(g + 5)) + c + __ldg(g + 2);
}

// Uniform dispatch on the SR flag (once per block, not per element); the Philox counter is flat / 16, where `flat`
// is the block's first element's index in the SR stream (the global stored data, see Args::stream_row), a multiple
// of 16; the 16 values take bytes 0..15 of that one Philox output.
__device__ __forceinline__ uint32_t EncodeNvfp4(const float (&v)[16], float bamax, float enc, bool local, bool sr,
                                                 int64_t flat, const uint32_t* key, uint8_t* dst,
                                                 const float* tab = nullptr, bool exact = false) {
  if (sr) {
    const uint4 r = cvt::Philox(uint32_t(flat >> 4), key[0], key[1]);
    const uint32_t rnd[4] = {r.x, r.y, r.z, r.w};
    return EncodeNvfp4<true>(v, bamax, enc, local, tab, rnd, dst, exact);
  }
  const uint32_t rnd[4] = {0u, 0u, 0u, 0u};
  return EncodeNvfp4<false>(v, bamax, enc, local, tab, rnd, dst, exact);
}

// MXFP8 encode of 16 values of a 32-block with E8M0 code e; writes 16 bytes through `store(i, byte)`.
template <int kKind>
__device__ __forceinline__ void EncodeMxfp8(const float (&v)[16], uint32_t e, uint32_t (&out)[4]) {
  const float mult = cvt::E8M0InverseScale(e);
#pragma unroll
  for (int i = 0; i < 16; i += 2) {
    const float a = __fmul_rn(v[i], mult), b = __fmul_rn(v[i + 1], mult);
    const uint32_t pair = (kKind == kMxfp8E4m3) ? cvt::E4M3x2(a, b) : cvt::E5M2x2(a, b);
    if ((i & 2) == 0) out[i / 4] = pair;
    else out[i / 4] |= pair << 16;
  }
}

template <int kKind>
__device__ __forceinline__ uint32_t Mxfp8ScaleCode(float bamax) {
  return cvt::E8M0FromFloat(__fmul_rn(bamax, kKind == kMxfp8E4m3 ? cvt::kInv448() : cvt::kInv57344()));
}

// The tile staged in shared memory as fp32: 64 rows x 16 chunks of 4 floats, chunk q of row r stored at
// TileChunk(r, q). Rows are written and read back as 16-byte chunks (a quarter warp: rows r, r + 1 x 4 column groups
// hit 8 different bank groups); columns are read as single floats (8 columns x 4 segments 16 rows apart a warp, or
// 32 columns of one row) without bank conflicts either.
__device__ __forceinline__ int TileChunk(int r, int q) {
  return q ^ (((q >> 3) & 1) << 1) ^ (r & 1) ^ (((r >> 4) & 3) << 1);
}

// The tile's row stride in 16-byte chunks. Plain NVFP4 columnwise kernels (kPadded) pad each row by 4 chunks and
// store chunk q = 4 cg + h of row r at 4 h + (cg ^ ((r >> 4) & 3)), so that a thread's four row chunks and its
// column's 16 values each sit at one base address plus constant offsets, instead of a per-chunk XOR recomputed every
// tile (static SASS of the NVFP4 row+col kernel: 1088 -> 1032 instructions). The other kernels keep TileChunk: the
// MXFP8 columnwise warps read 32 adjacent columns of one row, which the padded layout spreads over 16 banks only,
// and the NVFP4 kernels with options ran 1-3 % slower with it. Either layout is free of bank
// conflicts for a quarter warp's row chunks (rows r, r + 1 x 4 column groups) and a warp's column reads.
template <int kCol, bool kPlain>
constexpr bool kPadded = kCol == kNvfp4 && kPlain;
template <int kCol, bool kPlain>
__device__ __forceinline__ constexpr int TileRowChunks() { return kPadded<kCol, kPlain> ? 20 : 16; }
// Padded layout only (the unpadded kernels index tile[r][TileChunk(r, q)] in place: through a pointer helper their
// SASS grew by 8-16 instructions and the 2D / SR row+col kernels lost 1.3 % of copy).
// Chunk h of row segment cg (columns 16 cg + 4 h ..) of tile row r.
__device__ __forceinline__ float4* RowChunk(float4 (&tile)[kTile][20], int r, int cg, int h) {
  return &tile[0][0] + (r * 20 + (cg ^ ((r >> 4) & 3)) + 4 * h);
}
// The chunk holding element i of column segment rb (row 16 rb + i) of tile column lc.
__device__ __forceinline__ const float4* ColChunk(const float4 (&tile)[kTile][20], int rb, int i, int lc) {
  return &tile[0][0] + (rb * 320 + 4 * ((lc >> 2) & 3) + ((lc >> 4) ^ rb) + 20 * i);
}

// MXFP8 columnwise multipliers [32-row half][column]: column c at c + 4 * (c / 16), so that the four 16-byte reads
// of the four column groups of a row fall in different banks.
__device__ __forceinline__ int MultIndex(int c) { return c + ((c >> 4) << 2); }

// Shared-memory exchange arrays of one tile (every tile routine declares one set; sizes are fixed by kTile).
struct TileShared {
  float row_tile_amax[kTile][4];  // rowwise 1x16 block amaxes (2D tiles)
  float col_red[4][kTile];        // columnwise segment amaxes (MXFP8 pairs, 2D tiles, 1x64 windows)
  float col_sum[4][kTile];        // dbias partials
  float err46[2][4 * kTile];      // 4over6 2D: each segment's map-to-4 / map-to-6 error (thread-indexed)
};

// NVFP4 tensor encode scale of one orientation: S_enc on the E4M3 bound its options give (448, or 256 for 4over6).
__device__ __forceinline__ float TensorEncodeScale(float amax, int opts) {
  return (opts & kBound256) ? four_over_six::GlobalEncodeScale(amax, 256.0f) : cvt::GlobalEncodeScale(amax);
}

// 4over6 of one segment (four_over_six.cuh): both candidates, the choice (2D: per 16x16 tile, from the errors of
// the tile's 16 segments `slot0 + i * stride` exchanged through sh.err46 in TE's tree order; the barrier is reached
// by every thread), and, when `in`, the chosen codes (or exact operand) at dst. Returns the chosen scale code.
__device__ __forceinline__ uint32_t Encode4over6(const float (&v)[16], float bamax, float amax, float enc, int opts,
                                                 TileShared& sh, int slot, int slot0, int stride, bool in,
                                                 uint8_t* dst, bool exact) {
  const four_over_six::Pair c = four_over_six::Candidates(v, bamax, amax, enc, E4m3Bound(opts), opts & kMse);
  bool pick4 = four_over_six::PickMap4(c.c[0].err, c.c[1].err);
  if (opts & k2d) {
    sh.err46[0][slot] = c.c[0].err;
    sh.err46[1][slot] = c.c[1].err;
    __syncthreads();
    float e4[16], e6[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      e4[i] = sh.err46[0][slot0 + i * stride];
      e6[i] = sh.err46[1][slot0 + i * stride];
    }
    pick4 = four_over_six::PickMap4(four_over_six::TileSum(e4), four_over_six::TileSum(e6));
  }
  const four_over_six::Candidate& s = pick4 ? c.c[0] : c.c[1];
  if (in) {
    const uint2 w = make_uint2(s.w[0], s.w[1]);
    if (exact) {
      StoreExactNvfp4(w, s.sc, dst);
    } else {
      *reinterpret_cast<uint2*>(dst) = w;
    }
  }
  return s.sc;
}

// ---- rowwise steps: thread (lr, cg) holds row segment v = x[p][m, k..k+16), m = m0 + lr, k = k0 + 16 cg ----------
// NVFP4 rowwise: block amax (2D: the 16x16 tile's, exchanged through shared memory, so the branch on k2d is uniform and
// its barrier is reached by every thread), encode, store data, scale and (1x64) window amax. v is RHT'd in place.
// `flat`: the segment's element index in x and in the stored [P, M, K], (p * M + m) * K + k (computed once per tile).
__device__ __forceinline__ void RowNvfp4(const Args& a, int opts, float (&v)[16], TileShared& sh, int lr, int cg,
                                         bool row_in, int64_t p, int64_t m, int64_t k, int64_t flat, float enc_row,
                                         const float* tab_row, bool exact) {
  const int64_t M = a.M;
  if (opts & kRht) cvt::RhtForward16(v);
  float bamax = Max16(v);
  float wamax = fmaxf(bamax, __shfl_xor_sync(0xffffffffu, bamax, 1));
  wamax = fmaxf(wamax, __shfl_xor_sync(0xffffffffu, wamax, 2));
  if (opts & k2d) {
    sh.row_tile_amax[lr][cg] = bamax;
    __syncthreads();
    const int r0 = lr & ~15;
    float tm = 0.0f;
#pragma unroll
    for (int r = 0; r < 16; ++r) tm = fmaxf(tm, sh.row_tile_amax[r0 + r][cg]);
    bamax = tm;
  }
  if (opts & k4over6) {  // thread (lr, cg) is slot 4 lr + cg; its tile's rows are lr & ~15 .. + 15
    uint8_t* dst = exact ? a.row_data + 2 * flat : a.row_data + flat / 2;
    const uint32_t sc = Encode4over6(v, bamax, a.amax_row[p], enc_row, opts, sh, 4 * lr + cg, 4 * (lr & ~15) + cg, 4,
                                     row_in, dst, exact);
    if (row_in) {
      a.row_scale[a.swizzled ? SwizzledIndex(p * M + m, k >> 4, a.row_scale_cols_padded) : flat >> 4] = uint8_t(sc);
    }
    return;
  }
  if (row_in) {
    const bool local = opts & k1x64;
    const float enc = local ? cvt::WindowEncodeScale(wamax) : enc_row;
    const bool sr = opts & kSr;
    const int64_t sflat = sr ? StreamIndex(a.stream_row, flat, p, m, k) : flat;
    uint8_t* dst = exact ? a.row_data + 2 * flat : a.row_data + flat / 2;
    const uint32_t sc = EncodeNvfp4(v, bamax, enc, local, sr, sflat, a.key_row, dst, tab_row, exact);
    // compact scale S[p * M + m, k / 16] sits at flat / 16 (K % 16 == 0, k % 16 == 0)
    a.row_scale[a.swizzled ? SwizzledIndex(p * M + m, k >> 4, a.row_scale_cols_padded) : flat >> 4] = uint8_t(sc);
    if (local && cg == 0) a.row_wamax[flat >> 6] = wamax;  // [P * M, K / 64]: k % 64 == 0 here
  }
}

// MXFP8 rowwise: the 32-block is the segments of lanes cg and cg ^ 1.
template <int kKind>
__device__ __forceinline__ void RowMxfp8(const Args& a, const float (&v)[16], int cg, bool row_in, int64_t p,
                                         int64_t m, int64_t k, int64_t flat, bool exact) {
  float bamax = Max16(v);
  bamax = fmaxf(bamax, __shfl_xor_sync(0xffffffffu, bamax, 1));
  if (row_in) {
    const uint32_t e = Mxfp8ScaleCode<kKind>(bamax);
    uint32_t out[4];
    EncodeMxfp8<kKind>(v, e, out);
    if (exact) {
      uint32_t o[8];
      ExactMxfp8Block<kKind>(out, e, o);
      StoreBf16x16(a.row_data + 2 * flat, o, 16, true);
    } else {
      *reinterpret_cast<uint4*>(a.row_data + flat) = make_uint4(out[0], out[1], out[2], out[3]);
    }
    if ((cg & 1) == 0) {  // compact scale S[p * M + m, k / 32] sits at flat / 32 (K % 32 == 0, k % 32 == 0)
      a.row_scale[a.swizzled ? SwizzledIndex(p * a.M + m, k >> 5, a.row_scale_cols_padded) : flat >> 5] = uint8_t(e);
    }
  }
}

// ---- columnwise steps: thread (lc, rb) holds column segment c = x[p][mc..mc+16, kc], kc = k0 + lc, mc = m0 + 16 rb --
// Thread -> (lc, rb): NVFP4 puts the 4 segments of one column in adjacent lanes (a warp stores 8 output rows x 32
// contiguous bytes of the transposed data); MXFP8 puts 32 adjacent columns in a warp (its scales are [M/32, K]).
template <int kCol>
__device__ __forceinline__ int ColOfThread(int t) { return kCol == kNvfp4 ? (t >> 2) : (t & 63); }
template <int kCol>
__device__ __forceinline__ int SegOfThread(int t) { return kCol == kNvfp4 ? (t & 3) : (t >> 6); }

// First columnwise step, before the barrier that publishes sh.col_red / sh.col_sum: dbias partial sum (in row order,
// from +0), RHT (NVFP4), segment amax (returned, and published in sh.col_red).
template <int kCol>
__device__ __forceinline__ float ColSegmentAmax(const Args& a, int opts, float (&c)[16], TileShared& sh, int lc,
                                                int rb) {
  if (a.dbias != nullptr) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) s = __fadd_rn(s, c[i]);
    sh.col_sum[rb][lc] = s;
  }
  if constexpr (kCol == kNvfp4) {
    if (opts & kRht) cvt::RhtForward16(c);
  }
  const float amax = Max16(c);
  sh.col_red[rb][lc] = amax;
  return amax;
}

// Whether the columnwise step reads other threads' sh.col_red / sh.col_sum (MXFP8 32-blocks, NVFP4 2D tiles and 1x64
// windows, dbias), i.e. needs the barrier after ColSegmentAmax. Uniform over the block. A 1D NVFP4 block is the
// thread's own segment, so without dbias that barrier is skipped.
template <int kCol>
__device__ __forceinline__ bool ColNeedsExchange(const Args& a, int opts) {
  return kCol != kNvfp4 || a.dbias != nullptr || (opts & (k2d | k1x64)) != 0;
}

// dbias of one 64-row tile: ((s0 + s1) + s2) + s3 per column, after the barrier.
__device__ __forceinline__ void ColDbias(const Args& a, const TileShared& sh, int lc, int rb, int64_t p, int64_t mt,
                                         int64_t kc) {
  if (a.dbias != nullptr && rb == 0 && kc < a.K) {
    const float s = __fadd_rn(__fadd_rn(__fadd_rn(sh.col_sum[0][lc], sh.col_sum[1][lc]), sh.col_sum[2][lc]),
                              sh.col_sum[3][lc]);
    a.dbias[(p * ((a.M + kTile - 1) / kTile) + mt) * a.K + kc] = s;
  }
}

// NVFP4 columnwise encode after the barrier (if ColNeedsExchange): block amax (1D: seg_amax, the segment's own; 2D:
// the 16 columns' segment amaxes; 1x64: the window of 4 segments), data (x[p].T layout) and scale stores.
__device__ __forceinline__ void ColNvfp4(const Args& a, int opts, const float (&c)[16], TileShared& sh, int lc,
                                         int rb, bool col_in, int64_t p, int64_t kc, int64_t mc, float enc_col,
                                         const float* tab_col, bool exact, float seg_amax) {
  const int64_t M = a.M, K = a.K;
  float bamax = seg_amax;
  if (opts & k2d) {  // 16x16 tile: segment rb of the 16 columns of lc's group
    const int c0 = lc & ~15;
    float tm = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) tm = fmaxf(tm, sh.col_red[rb][c0 + j]);
    bamax = tm;
  }
  if (opts & k4over6) {  // thread (lc, rb) is slot 64 rb + lc; its tile's columns are lc & ~15 .. + 15
    const int64_t flat = (p * K + kc) * M + mc;
    uint8_t* dst = exact ? a.col_data + 2 * flat : a.col_data + flat / 2;
    const uint32_t sc = Encode4over6(c, bamax, a.amax_col[p], enc_col, opts, sh, 64 * rb + lc, 64 * rb + (lc & ~15),
                                     1, col_in, dst, exact);
    if (col_in) {
      a.col_scale[a.swizzled ? SwizzledIndex(p * K + kc, mc >> 4, a.col_scale_cols_padded) : flat >> 4] = uint8_t(sc);
    }
    return;
  }
  if (!col_in) return;
  const bool local = opts & k1x64;
  float enc = enc_col, wamax = 0.0f;
  if (local) {
    wamax = fmaxf(fmaxf(sh.col_red[0][lc], sh.col_red[1][lc]), fmaxf(sh.col_red[2][lc], sh.col_red[3][lc]));
    enc = cvt::WindowEncodeScale(wamax);
  }
  const int64_t flat = (p * K + kc) * M + mc;  // element index in the stored [P, K, M]
  const bool sr = opts & kSr;
  const int64_t sflat = sr ? StreamIndex(a.stream_col, flat, p, kc, mc) : flat;
  uint8_t* dst = exact ? a.col_data + 2 * flat : a.col_data + flat / 2;
  const uint32_t sc = EncodeNvfp4(c, bamax, enc, local, sr, sflat, a.key_col, dst, tab_col, exact);
  // compact scale S[p * K + kc, mc / 16] sits at flat / 16 (M % 16 == 0, mc % 16 == 0)
  a.col_scale[a.swizzled ? SwizzledIndex(p * K + kc, mc >> 4, a.col_scale_cols_padded) : flat >> 4] = uint8_t(sc);
  if (local && rb == 0) a.col_wamax[flat >> 6] = wamax;  // [P * K, M / 64]: mc % 64 == 0 here
}

// MXFP8 columnwise E8M0 code of the 32-block of segments rb and rb ^ 1 (after the barrier); the scale is stored by the
// even segment. Returns the code.
template <int kKind>
__device__ __forceinline__ uint32_t ColMxfp8Scale(const Args& a, const TileShared& sh, int lc, int rb, bool col_in,
                                                  int64_t p, int64_t kc, int64_t mc) {
  const uint32_t e = Mxfp8ScaleCode<kKind>(fmaxf(sh.col_red[rb][lc], sh.col_red[rb ^ 1][lc]));
  if (col_in && (rb & 1) == 0) {
    const int64_t sj = mc >> 5;
    if (a.swizzled) {
      a.col_scale[SwizzledIndex(p * a.K + kc, sj, a.col_scale_cols_padded)] = uint8_t(e);
    } else {
      a.col_scale[(p * (a.M >> 5) + sj) * a.K + kc] = uint8_t(e);
    }
  }
  return e;
}

}  // namespace quantize
}  // namespace jax_fp4
