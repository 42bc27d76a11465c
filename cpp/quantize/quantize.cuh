// Rowwise + columnwise block-scaled quantization of x[P, M, K] from one read (NUMERICS.md sections 1-3).
//
// One thread block owns a 64x64 tile of one x[p] (256 threads). Thread t loads the 1x16 row segment
// (row t/4, columns 16*(t%4)...) with vector loads and keeps it in registers for the rowwise output; the tile is
// also staged in shared memory as fp32, from which thread t reads the 16x1 column segment (column t%64, rows
// 16*(t/64)...) for the columnwise output. 64 = the 1x64 window, so every block size (16 NVFP4, 32 MXFP8, 16x16 2D
// tiles, 64 windows) closes inside a tile: block amaxes combine through warp shuffles (rows) or shared memory
// (columns). No atomics, no global scratch: every output byte is written exactly once (CUDA-graph safe).
//
// Formats are compile-time "kinds" (one template for every pairing, including NVFP4 rowwise + MXFP8 columnwise);
// NVFP4 options (SR, RHT, 2D, 1x64) are uniform runtime flags.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/convert.cuh"
#include "common/e2m1.cuh"

namespace jax_fp4 {
namespace quantize {

enum Kind : int { kNone = 0, kNvfp4 = 1, kMxfp8E4m3 = 2, kMxfp8E5m2 = 3 };
enum Option : int { kSr = 1, kRht = 2, k2d = 4, k1x64 = 8 };

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

// Loads 16 consecutive elements (vectorised when aligned); elements past `valid` read as 0.
template <typename In>
__device__ __forceinline__ void Load16(const In* src, int valid, bool vector, float (&v)[16]) {
  if (vector && valid >= 16) {
    constexpr int kPerVec = 16 / sizeof(In);
    const uint4* s = reinterpret_cast<const uint4*>(src);
#pragma unroll
    for (int q = 0; q < 16 / kPerVec; ++q) {
      const uint4 w = __ldg(s + q);
      const In* e = reinterpret_cast<const In*>(&w);
#pragma unroll
      for (int i = 0; i < kPerVec; ++i) v[q * kPerVec + i] = ToFloat<In>(e[i]);
    }
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

// NVFP4 encode of one 1x16 block with its (block / 2D-tile) amax. `enc` is S_enc (1D/2D) or S_enc,w (1x64).
// Writes 8 packed bytes to dst (8-byte aligned) and returns the E4M3 scale code. kSr: stochastic rounding with the
// 16 random bytes `rnd` (one Philox output).
template <bool kSr>
__device__ __forceinline__ uint32_t EncodeNvfp4(const float (&v)[16], float bamax, float enc, bool local,
                                                 const uint32_t (&rnd)[4], uint8_t* dst) {
  const uint32_t sc = cvt::E4M3(__fmul_rn(bamax, __fmul_rn(enc, cvt::kInv6())));
  const float s_b = cvt::E4M3Value(sc);
  float mult;
  if (local) {
    mult = s_b == 0.0f ? 0.0f : __fdiv_rn(enc, s_b);
  } else {
    mult = fminf(__frcp_rn(__fmul_rn(s_b, __frcp_rn(enc))), FLT_MAX);
  }
  *reinterpret_cast<uint2*>(dst) = make_uint2(e2m1::Pack8<kSr>(v, mult, rnd, 0), e2m1::Pack8<kSr>(v + 8, mult, rnd, 8));
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
                                                 int64_t flat, const uint32_t* key, uint8_t* dst) {
  if (sr) {
    const uint4 r = cvt::Philox(uint32_t(flat >> 4), key[0], key[1]);
    const uint32_t rnd[4] = {r.x, r.y, r.z, r.w};
    return EncodeNvfp4<true>(v, bamax, enc, local, rnd, dst);
  }
  const uint32_t rnd[4] = {0u, 0u, 0u, 0u};
  return EncodeNvfp4<false>(v, bamax, enc, local, rnd, dst);
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

// One 64x64 tile (rows m0.., columns k0.. of x[p]; mt = m0 / 64). enc_row / enc_col: the NVFP4 tensor encode scales
// (unused for 1x64 and MXFP8). Every barrier inside is reached by all threads of the block.
template <typename In, int kRow, int kCol, bool kPlain>
__device__ __forceinline__ void QuantizeTile(const Args& a, int64_t p, int64_t mt, int64_t k0, float enc_row,
                                             float enc_col) {
  constexpr bool kNeedTile = kCol != kNone;
  __shared__ float tile[kNeedTile ? kTile : 1][kTile + 1];
  __shared__ float row_tile_amax[kTile][4];  // rowwise 1x16 block amaxes (2D tiles)
  __shared__ float col_red[4][kTile];        // columnwise exchanges (MXFP8 pairs, 1x64 windows)
  __shared__ float col_sum[4][kTile];        // dbias partials

  const int t = threadIdx.x;
  const int64_t m0 = mt * kTile;
  const int64_t M = a.M, K = a.K;
  const In* x = static_cast<const In*>(a.x) + p * M * K;

  // ---- load: row segment of thread t ----
  const int lr = t >> 2, cg = t & 3;
  const int64_t m = m0 + lr, k = k0 + cg * 16;
  const bool row_in = m < M && k < K;
  const int valid = row_in ? int(K - k < 16 ? K - k : 16) : 0;
  float v[16];
  Load16<In>(x + m * K + k, valid, a.vector_loads, v);
  if constexpr (kNeedTile) {
#pragma unroll
    for (int i = 0; i < 16; ++i) tile[lr][cg * 16 + i] = v[i];
  }

  // ---- rowwise ----
  if constexpr (kRow == kNvfp4) {
    const int opts = kPlain ? 0 : a.row_opts;
    if (opts & kRht) cvt::RhtForward16(v);  // v is already staged in shared memory for the columnwise pass
    float bamax = Max16(v);
    float wamax = fmaxf(bamax, __shfl_xor_sync(0xffffffffu, bamax, 1));
    wamax = fmaxf(wamax, __shfl_xor_sync(0xffffffffu, wamax, 2));
    if (opts & k2d) {  // uniform branch: the barrier is reached by every thread or none
      row_tile_amax[lr][cg] = bamax;
      __syncthreads();
      const int r0 = lr & ~15;
      float tm = 0.0f;
#pragma unroll
      for (int r = 0; r < 16; ++r) tm = fmaxf(tm, row_tile_amax[r0 + r][cg]);
      bamax = tm;
    }
    if (row_in) {
      const bool local = opts & k1x64;
      const float enc = local ? cvt::WindowEncodeScale(wamax) : enc_row;
      const int64_t flat = (p * M + m) * K + k;  // element index in the stored [P, M, K]
      const bool sr = opts & kSr;
      const int64_t sflat = sr ? StreamIndex(a.stream_row, flat, p, m, k) : flat;
      const uint32_t sc = EncodeNvfp4(v, bamax, enc, local, sr, sflat, a.key_row, a.row_data + flat / 2);
      const int64_t si = p * M + m, sj = k >> 4;
      a.row_scale[a.swizzled ? SwizzledIndex(si, sj, a.row_scale_cols_padded) : si * (K >> 4) + sj] = uint8_t(sc);
      if (local && cg == 0) a.row_wamax[si * (K >> 6) + (k >> 6)] = wamax;
    }
  } else if constexpr (kRow != kNone) {  // MXFP8: a 32-block spans threads (cg, cg^1)
    float bamax = Max16(v);
    bamax = fmaxf(bamax, __shfl_xor_sync(0xffffffffu, bamax, 1));
    if (row_in) {
      const uint32_t e = Mxfp8ScaleCode<kRow>(bamax);
      uint32_t out[4];
      EncodeMxfp8<kRow>(v, e, out);
      const int64_t flat = (p * M + m) * K + k;
      *reinterpret_cast<uint4*>(a.row_data + flat) = make_uint4(out[0], out[1], out[2], out[3]);
      if ((cg & 1) == 0) {
        const int64_t si = p * M + m, sj = k >> 5;
        a.row_scale[a.swizzled ? SwizzledIndex(si, sj, a.row_scale_cols_padded) : si * (K >> 5) + sj] = uint8_t(e);
      }
    }
  }

  if constexpr (!kNeedTile) {
    return;
  } else {
    __syncthreads();
    // ---- columnwise: column segment of thread t ----
    // NVFP4: the 4 segments of one column are adjacent lanes, so a warp stores 8 output rows x 32 contiguous bytes
    // (columnwise NVFP4 data is x[p].T). MXFP8 keeps x's layout: 32 adjacent columns per warp store 32 bytes a row.
    const int lc = kCol == kNvfp4 ? (t >> 2) : (t & 63);
    const int rb = kCol == kNvfp4 ? (t & 3) : (t >> 6);
    const int64_t kc = k0 + lc, mc = m0 + rb * 16;
    const bool col_in = kc < K && mc < M;  // M % 16 == 0 (M % 32 for MXFP8): segments are whole
    float c[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) c[i] = tile[rb * 16 + i][lc];
    if (a.dbias != nullptr) {
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) s = __fadd_rn(s, c[i]);
      col_sum[rb][lc] = s;
    }
    const int opts = kPlain ? 0 : a.col_opts;
    if constexpr (kCol == kNvfp4) {
      if (opts & kRht) cvt::RhtForward16(c);
    }
    float bamax = Max16(c);
    col_red[rb][lc] = bamax;
    __syncthreads();
    if constexpr (kCol == kNvfp4) {
      if (opts & k2d) {  // 16x16 tile: segment rb of the 16 columns of lc's group
        const int c0 = lc & ~15;
        float tm = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) tm = fmaxf(tm, col_red[rb][c0 + j]);
        bamax = tm;
      }
    }
    if (a.dbias != nullptr && rb == 0 && kc < K) {
      const float s = __fadd_rn(__fadd_rn(__fadd_rn(col_sum[0][lc], col_sum[1][lc]), col_sum[2][lc]), col_sum[3][lc]);
      a.dbias[(p * ((M + kTile - 1) / kTile) + mt) * K + kc] = s;
    }
    if (!col_in) return;
    if constexpr (kCol == kNvfp4) {
      const bool local = opts & k1x64;
      float enc;
      float wamax = 0.0f;
      if (local) {
        wamax = fmaxf(fmaxf(col_red[0][lc], col_red[1][lc]), fmaxf(col_red[2][lc], col_red[3][lc]));
        enc = cvt::WindowEncodeScale(wamax);
      } else {
        enc = enc_col;
      }
      const int64_t flat = (p * K + kc) * M + mc;  // element index in the stored [P, K, M]
      const bool sr = opts & kSr;
      const int64_t sflat = sr ? StreamIndex(a.stream_col, flat, p, kc, mc) : flat;
      const uint32_t sc = EncodeNvfp4(c, bamax, enc, local, sr, sflat, a.key_col, a.col_data + flat / 2);
      const int64_t si = p * K + kc, sj = mc >> 4;
      a.col_scale[a.swizzled ? SwizzledIndex(si, sj, a.col_scale_cols_padded) : si * (M >> 4) + sj] = uint8_t(sc);
      if (local && rb == 0) a.col_wamax[si * (M >> 6) + (mc >> 6)] = wamax;
    } else {  // MXFP8 columnwise: the 32-block is segments rb and rb^1; data keeps x's [P, M, K] layout
      bamax = fmaxf(col_red[rb][lc], col_red[rb ^ 1][lc]);
      const uint32_t e = Mxfp8ScaleCode<kCol>(bamax);
      uint32_t out[4];
      EncodeMxfp8<kCol>(c, e, out);
      uint8_t* dst = a.col_data + (p * M + mc) * K + kc;
#pragma unroll
      for (int i = 0; i < 16; ++i) dst[int64_t(i) * K] = uint8_t(out[i / 4] >> (8 * (i & 3)));
      if ((rb & 1) == 0) {
        const int64_t sj = mc >> 5;
        if (a.swizzled) {
          a.col_scale[SwizzledIndex(p * K + kc, sj, a.col_scale_cols_padded)] = uint8_t(e);
        } else {
          a.col_scale[(p * (M >> 5) + sj) * K + kc] = uint8_t(e);
        }
      }
    }
  }
}

// Thread block (blockIdx.x, blockIdx.y, p) walks tiles_per_cta tiles down the rows, so that the per-thread setup and
// the tensor encode scales are computed once per block.
template <typename In, int kRow, int kCol, bool kPlain>
__global__ void __launch_bounds__(kThreads) QuantizeKernel(const Args a) {
  const int64_t p = blockIdx.z, k0 = int64_t(blockIdx.x) * kTile;
  const int64_t m_tiles = (a.M + kTile - 1) / kTile;
  const int row_opts = kPlain ? 0 : a.row_opts, col_opts = kPlain ? 0 : a.col_opts;
  const float enc_row = (kRow == kNvfp4 && !(row_opts & k1x64)) ? cvt::GlobalEncodeScale(a.amax_row[p]) : 1.0f;
  const float enc_col = (kCol == kNvfp4 && !(col_opts & k1x64)) ? cvt::GlobalEncodeScale(a.amax_col[p]) : 1.0f;
  const int64_t mt0 = int64_t(blockIdx.y) * a.tiles_per_cta;
  const int64_t mt1 = mt0 + a.tiles_per_cta < m_tiles ? mt0 + a.tiles_per_cta : m_tiles;
  for (int64_t mt = mt0; mt < mt1; ++mt) {  // uniform trip count: the barriers below are reached by all threads
    QuantizeTile<In, kRow, kCol, kPlain>(a, p, mt, k0, enc_row, enc_col);
    __syncthreads();  // shared memory is reused by the next tile
  }
}

// Host-side launch: grid (ceil(K/64), ceil(ceil(M/64) / tiles_per_cta), P).
template <typename In, int kRow, int kCol>
cudaError_t Launch(Args args, cudaStream_t stream) {
  const int64_t k_tiles = (args.K + kTile - 1) / kTile, m_tiles = (args.M + kTile - 1) / kTile;
  const int64_t tiles = k_tiles * m_tiles * args.P;
  const bool nvfp4 = kRow == kNvfp4 || kCol == kNvfp4;
  // NVFP4 is issue-bound (software E2M1): amortise the setup over 2-4 tiles (>= 512 blocks either way). MXFP8 is
  // memory-bound and measured faster with one tile per block (more independent loads in flight).
  args.tiles_per_cta = !nvfp4 ? 1 : (tiles >= 2048 ? 4 : (tiles >= 256 ? 2 : 1));
  const dim3 grid(unsigned(k_tiles), unsigned((m_tiles + args.tiles_per_cta - 1) / args.tiles_per_cta),
                  unsigned(args.P));
  if (nvfp4 && args.row_opts == 0 && args.col_opts == 0) {
    QuantizeKernel<In, kRow, kCol, true><<<grid, kThreads, 0, stream>>>(args);
  } else {
    QuantizeKernel<In, kRow, kCol, false><<<grid, kThreads, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace quantize
}  // namespace jax_fp4
