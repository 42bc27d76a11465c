// Grouped (MoE) quantize: N groups x_g [M_g, K_g] of one buffer in ONE persistent launch (docs/numerics.md section 4),
// bit-exact to jax_fp4.reference.grouped.quantize_groups.
//
// Scheduling (group_table.cuh): each group contributes work units, plus a tail pseudo-group that zero-fills the
// buffer past the last group (data code 0, scale code 0).
//  * Tile path (every aligned group whose offset is a multiple of 16 and that fits the buffer: the normal case):
//    ceil(M_g / 64) * ceil(K_g / 64) tiles, each handed to the single-tensor tile routine quantize::QuantizeTile with
//    an Args describing the group as a [1, M_g, K_g] tensor: x, data, scales and SR key offset to the group (data at
//    offsets[g] (NVFP4: / 2 bytes), scales at offsets[g] / block), its tensor encode scale from the per-group amax.
//    The tile code is shared with jf4_quantize, not copied.
//  * Generic path (a group whose block axis is misaligned -- traced sizes -- or that follows one, so its offset is
//    not 16-aligned, or that overruns the buffer): one thread per internal 16- (NVFP4) / 32-block (MXFP8) of the
//    group's oriented order, gathering its elements like the reference (including the reference's padding reads
//    past a misaligned group), with the same encode device functions. Misaligned groups are poisoned like the
//    reference: scale codes NaN (E4M3 0x7F, E8M0 0xFF), MXFP8 data 0x7F, NVFP4 amax NaN; their E2M1 codes are what
//    the reference computes. NVFP4 data bytes shared by two groups (odd offsets) are written whole by the owner of
//    the low nibble, which also encodes the next element (the next block's, or the next non-empty group's first).
// Every output byte is written exactly once. The one atomic is the unit counter of the dynamic scheduling (below),
// an int32 the caller zeroes before the launch (CUDA-graph safe: no host sync, no allocation).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/convert.cuh"
#include "grouped/group_table.cuh"
#include "quantize/quantize.cuh"

namespace jax_fp4 {
namespace grouped {

struct QuantArgs {
  const void* x;
  int64_t size;
  int n;
  const int32_t* first_dims;  // [N]
  const int32_t* last_dims;   // [N]
  const uint32_t* key_row;    // [N, 2] Philox key words per group
  const uint32_t* key_col;
  const float* amax_row;      // [N] per-group NVFP4 amaxes (GroupedAmaxKernel's or given); null without that side
  const float* amax_col;      // [N]
  uint8_t* row_data;
  uint8_t* row_scale;
  float* row_amax;            // [N] output (poisoned)
  uint8_t* col_data;
  uint8_t* col_scale;
  float* col_amax;
  int row_opts, col_opts;
  int32_t* work;  // the dynamic scheduling counter: one int32 the caller zeroes before each launch
};

using quantize::kMxfp8E4m3;
using quantize::kMxfp8E5m2;
using quantize::kNone;
using quantize::kNvfp4;

__host__ __device__ constexpr int BlockOf(int kind) { return kind == kNvfp4 ? 16 : 32; }

// 64-row tiles per tile-path work unit, walked down a group's rows as the single-tensor kernel does: MXFP8-only
// pairings with the next tile's row segment prefetched (quantize::QuantizeTilesPrefetched), NVFP4 ones tile by tile,
// so the unit's set-up (group lookup, arguments, encode scales) is paid once per 4 tiles (with one tile a unit the
// grouped NVFP4 row kernel took 1.7x the single-tensor one's time: docs/kernels/grouped.md).
constexpr int kTilesPerUnit = 4;

// Tile path eligibility: aligned block axes, a 16-aligned offset (the tile routine's vector stores) and inside x.
template <int kRow, int kCol>
__device__ __forceinline__ bool TilePath(const Table& t, int g) {
  if (t.off[g] % 16 != 0 || !t.Inside(g)) return false;
  if (kRow != kNone && t.cols[g] % BlockOf(kRow) != 0) return false;
  if (kCol != kNone && t.rows[g] % BlockOf(kCol) != 0) return false;
  return true;
}

// [begin, end) byte ranges of the tail (past the last group) of one orientation's data and scales.
template <int kKind>
__device__ __forceinline__ void TailRanges(const Table& t, int64_t* d0, int64_t* d1, int64_t* s0, int64_t* s1) {
  const int64_t end = t.off[t.n];
  *d0 = kKind == kNvfp4 ? (end + 1) / 2 : end;  // NVFP4: bytes whose low nibble lies past the groups
  *d1 = kKind == kNvfp4 ? (t.size + 1) / 2 : t.size;
  *s0 = end / BlockOf(kKind);
  *s1 = t.size / BlockOf(kKind);
}

template <int kRow, int kCol>
__device__ __forceinline__ int64_t QuantUnits(const Table& t, int g) {
  if (g == t.n) {
    int64_t bytes = 0, d0, d1, s0, s1;
    if (kRow != kNone) {
      TailRanges<kRow>(t, &d0, &d1, &s0, &s1);
      bytes = max(bytes, max(d1 - d0, s1 - s0));
    }
    if (kCol != kNone) {
      TailRanges<kCol>(t, &d0, &d1, &s0, &s1);
      bytes = max(bytes, max(d1 - d0, s1 - s0));
    }
    return CeilDiv(bytes, int64_t(kThreads) * 16);
  }
  const int64_t cnt = t.Count(g);
  if (cnt == 0) return 0;
  if (TilePath<kRow, kCol>(t, g)) {
    return CeilDiv(CeilDiv(t.rows[g], 64), kTilesPerUnit) * CeilDiv(t.cols[g], 64);
  }
  const int bs = (kRow == kNvfp4 || kCol == kNvfp4) ? 16 : 32;  // the smaller block of the two orientations
  return CeilDiv(CeilDiv(cnt, bs), kThreads);
}

template <int kKind>
__device__ __forceinline__ void ZeroTail(const Table& t, int64_t i0, uint8_t* data, uint8_t* scale) {
  int64_t d0, d1, s0, s1;
  TailRanges<kKind>(t, &d0, &d1, &s0, &s1);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    if (d0 + i0 + i < d1) data[d0 + i0 + i] = 0;
    if (s0 + i0 + i < s1) scale[s0 + i0 + i] = 0;
  }
}

// ---- generic path -----------------------------------------------------------------------------------------------
// NVFP4 codes (8 packed bytes, element i in nibble i) and the E4M3 scale code of internal block b of group g.
template <typename In>
__device__ __forceinline__ uint32_t Nvfp4Block(const QuantArgs& a, const Table& t, int g, int64_t b, bool col,
                                               int opts, uint2* codes) {
  const In* x = static_cast<const In*>(a.x);
  const int64_t off = t.off[g], m = t.rows[g], k = t.cols[g];
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int64_t l = 16 * b + i, src = off + (col ? O2C(l, m, k) : l);
    v[i] = src < a.size ? quantize::ToFloat<In>(x[src]) : 0.0f;
  }
  if (opts & quantize::kRht) cvt::RhtForward16(v);
  const float amax = (col ? a.amax_col : a.amax_row)[g];
  const float enc = quantize::TensorEncodeScale(amax, opts);
  if (opts & quantize::k4over6) {  // 1D: the block's own choice (four_over_six.cuh)
    const four_over_six::Pair p =
        four_over_six::Candidates(v, quantize::Max16(v), amax, enc, quantize::E4m3Bound(opts), opts & quantize::kMse);
    const four_over_six::Candidate& s = four_over_six::PickMap4(p.c[0].err, p.c[1].err) ? p.c[0] : p.c[1];
    *codes = make_uint2(s.w[0], s.w[1]);
    return s.sc;
  }
  const uint32_t* key = (col ? a.key_col : a.key_row) + 2 * int64_t(g);
  return quantize::EncodeNvfp4(v, quantize::Max16(v), enc, false, opts & quantize::kSr, 16 * b, key,
                               reinterpret_cast<uint8_t*>(codes));
}

__device__ __forceinline__ uint32_t Nibble(const uint2& c, int i) {
  return ((i < 8 ? c.x : c.y) >> (4 * (i & 7))) & 0xFu;
}

// Code of element q (= the end of group g): the first element of the next non-empty group, 0 past the groups.
template <typename In>
__device__ uint32_t NextGroupFirstCode(const QuantArgs& a, const Table& t, int g, int64_t q, bool col, int opts) {
  if (q >= a.size) return 0u;
  for (int h = g + 1; h < t.n; ++h) {
    if (t.Count(h) > 0) {
      uint2 c;
      Nvfp4Block<In>(a, t, h, 0, col, opts, &c);
      return c.x & 0xFu;
    }
  }
  return 0u;
}

template <typename In>
__device__ __forceinline__ void GenericNvfp4(const QuantArgs& a, const Table& t, int g, int64_t b, bool col, int opts,
                                             uint8_t* data, uint8_t* scale) {
  const int64_t off = t.off[g], cnt = t.Count(g);
  if (16 * b >= cnt) return;
  uint2 c;
  const uint32_t sc = Nvfp4Block<In>(a, t, g, b, col, opts, &c);
  for (int i = 0; i < 16; ++i) {
    const int64_t l = 16 * b + i, p = off + l;
    if (l >= cnt) break;
    if (p & 1) continue;  // a high nibble: written with its byte by the owner of element p - 1
    uint32_t hi;
    if (l + 1 < cnt) {
      if (i < 15) {
        hi = Nibble(c, i + 1);
      } else {
        uint2 c2;
        Nvfp4Block<In>(a, t, g, b + 1, col, opts, &c2);
        hi = c2.x & 0xFu;
      }
    } else {
      hi = NextGroupFirstCode<In>(a, t, g, p + 1, col, opts);
    }
    data[p >> 1] = uint8_t(Nibble(c, i) | (hi << 4));
  }
  const int64_t s = off / 16 + b;
  if (s < t.off[g + 1] / 16) {
    const bool misaligned = (col ? t.rows[g] : t.cols[g]) % 16 != 0;
    scale[s] = misaligned ? uint8_t(0x7F) : uint8_t(sc);
  }
}

// Internal (oriented) element l of group g as the reference gathers it: x[off + l] / x[off + o2c(l)], 0 past x.
template <typename In>
__device__ __forceinline__ float MxValue(const QuantArgs& a, const Table& t, int g, int64_t l, bool col) {
  const int64_t src = t.off[g] + (col ? O2C(l, t.rows[g], t.cols[g]) : l);
  return src < a.size ? quantize::ToFloat<In>(static_cast<const In*>(a.x)[src]) : 0.0f;
}

template <typename In, int kKind>
__device__ __forceinline__ void GenericMxfp8(const QuantArgs& a, const Table& t, int g, int64_t b, bool col,
                                             uint8_t* data, uint8_t* scale) {
  const int64_t off = t.off[g], cnt = t.Count(g), m = t.rows[g], k = t.cols[g], end = t.off[g + 1];
  if (32 * b >= cnt) return;
  const int64_t s_end = end / 32;
  if ((col ? m : k) % 32 != 0) {  // poisoned: NaN data and scales
    for (int i = 0; i < 32; ++i) {
      if (32 * b + i < cnt) data[off + 32 * b + i] = 0x7F;
    }
    if (off / 32 + b < s_end) scale[off / 32 + b] = 0xFF;
    return;
  }
  // Two passes over the 32 values (block amax, then encode 16 at a time): few live registers on this rare path.
  float bamax = 0.0f;
#pragma unroll 1
  for (int i = 0; i < 32; ++i) bamax = cvt::AbsMax(bamax, MxValue<In>(a, t, g, 32 * b + i, col));
  const uint32_t e = quantize::Mxfp8ScaleCode<kKind>(bamax);
#pragma unroll 1
  for (int h = 0; h < 2; ++h) {
    float v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = MxValue<In>(a, t, g, 32 * b + 16 * h + i, col);
    uint32_t o[4];
    quantize::EncodeMxfp8<kKind>(v, e, o);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int64_t l = 32 * b + 16 * h + i, p = off + (col ? O2C(l, m, k) : l);
      if (l < cnt && p < end) data[p] = uint8_t(o[i >> 2] >> (8 * (i & 3)));
    }
  }
  const int64_t s = off / 32 + (col ? O2C(b, m / 32, k) : b);
  if (s < s_end) scale[s] = uint8_t(e);
}

// ---- the kernel ---------------------------------------------------------------------------------------------------
// Resident blocks per SM (__launch_bounds__; the rare generic path may spill a little rather than cost the tile path
// occupancy), each the fastest measured (docs/kernels/grouped.md): NVFP4 rowwise 6 (40 registers), other NVFP4
// pairings 5, MXFP8 in one orientation 5 (as their single-tensor kernels), MXFP8 row+col 4.
template <int kRow, int kCol>
__host__ __device__ constexpr int MinBlocks() {
  constexpr bool kNv = kRow == kNvfp4 || kCol == kNvfp4, kOne = kRow == kNone || kCol == kNone;
  if (!kNv) return kOne ? 5 : 4;
  return kRow == kNvfp4 && kCol == kNone ? 6 : 5;
}

template <typename In, int kRow, int kCol, bool kPlain>
__global__ void __launch_bounds__(kThreads, MinBlocks<kRow, kCol>()) GroupedQuantizeKernel(const QuantArgs a) {
  extern __shared__ int32_t table_smem[];
  Table t = CarveTable(table_smem, a.n, a.size);
  BuildTable(t, a.first_dims, a.last_dims, [](const Table& tt, int g) { return QuantUnits<kRow, kCol>(tt, g); });
  const int row_opts = kPlain ? 0 : a.row_opts, col_opts = kPlain ? 0 : a.col_opts;
  if (blockIdx.x == 0) {  // the NVFP4 amax outputs, NaN for misaligned groups (read by no other block)
    for (int g = threadIdx.x; g < t.n; g += kThreads) {
      if (kRow == kNvfp4) a.row_amax[g] = t.cols[g] % 16 ? __uint_as_float(0x7FC00000u) : a.amax_row[g];
      if (kCol == kNvfp4) a.col_amax[g] = t.rows[g] % 16 ? __uint_as_float(0x7FC00000u) : a.amax_col[g];
    }
  }
  const In* x = static_cast<const In*>(a.x);
  // NVFP4 1D / 2D / RHT: the multiplier tables (quantize::MultiplierTable) of the group in `tab_g`, rebuilt when a
  // tile unit of another group comes up (uniform over the block; every tile unit ends with a barrier, so no thread
  // still reads the old tables), instead of two reciprocals per block and orientation.
  __shared__ float tab[2][128];
  int tab_g = -1;  // the group of enc_row / enc_col and the tables
  float enc_row = 1.0f, enc_col = 1.0f;
  const bool row_tab = kRow == kNvfp4 && !(row_opts & quantize::k1x64);
  const bool col_tab = kCol == kNvfp4 && !(col_opts & quantize::k1x64);
  // Dynamic scheduling: block b starts with unit b, then takes unit gridDim.x + c, c from an atomic counter that
  // thread 0 claims at the start of each unit (its latency hidden behind the unit). Units are taken in request order,
  // so the blocks at work stay on neighbouring units, as the hardware's block scheduler keeps the single-tensor
  // kernel's; a static grid stride let them drift apart (one group: mixed 71.5 % of copy against the single-tensor
  // kernel's 87 %).
  __shared__ int32_t claimed_smem[2];
  int parity = 0, g = 0;
  for (int64_t u = blockIdx.x; u < t.Total(); parity ^= 1) {
    int32_t claimed = 0;
    if (threadIdx.x == 0) claimed = atomicAdd(a.work, 1);
    if (u < t.units[g] || u >= t.units[g + 1]) g = FindGroup(t, int32_t(u));  // uniform over the block
    const int64_t lu = u - t.units[g];
    if (g == t.n) {
      const int64_t i0 = (lu * kThreads + threadIdx.x) * 16;
      if (kRow != kNone) ZeroTail<kRow>(t, i0, a.row_data, a.row_scale);
      if (kCol != kNone) ZeroTail<kCol>(t, i0, a.col_data, a.col_scale);
    } else {
      const int64_t off = t.off[g], m = t.rows[g], k = t.cols[g];
      if (TilePath<kRow, kCol>(t, g)) {
        quantize::Args q{};
        q.x = x + off;
        q.P = 1, q.M = m, q.K = k;
        q.key_row = a.key_row + 2 * int64_t(g);
        q.key_col = a.key_col + 2 * int64_t(g);
        if (kRow != kNone) {
          q.row_data = a.row_data + (kRow == kNvfp4 ? off / 2 : off);
          q.row_scale = a.row_scale + off / BlockOf(kRow);
        }
        if (kCol != kNone) {
          q.col_data = a.col_data + (kCol == kNvfp4 ? off / 2 : off);
          q.col_scale = a.col_scale + off / BlockOf(kCol);
        }
        q.row_opts = row_opts, q.col_opts = col_opts;
        q.amax_row = a.amax_row + g, q.amax_col = a.amax_col + g;  // the group's tensor amax (4over6's error)
        q.vector_loads = (k * int64_t(sizeof(In))) % 16 == 0 && reinterpret_cast<uintptr_t>(x + off) % 16 == 0;
        if ((kRow == kNvfp4 || kCol == kNvfp4) && g != tab_g) {
          if (kRow == kNvfp4) enc_row = quantize::TensorEncodeScale(a.amax_row[g], row_opts);
          if (kCol == kNvfp4) enc_col = quantize::TensorEncodeScale(a.amax_col[g], col_opts);
          if (row_tab) quantize::MultiplierTable(tab[0], enc_row, 0);
          if (col_tab) quantize::MultiplierTable(tab[1], enc_col, 128);
          if (row_tab || col_tab) __syncthreads();
          tab_g = g;
        }
        const uint32_t k_tiles = uint32_t(CeilDiv(k, quantize::kTile)), mb = uint32_t(lu) / k_tiles;
        const int64_t k0 = int64_t(uint32_t(lu) - mb * k_tiles) * quantize::kTile;
        // tiles [mt0, mt1) of the group, uniform over the block
        const int64_t mt0 = int64_t(mb) * kTilesPerUnit, m_tiles = CeilDiv(m, quantize::kTile);
        const int64_t mt1 = mt0 + kTilesPerUnit < m_tiles ? mt0 + kTilesPerUnit : m_tiles;
        const quantize::TileContext ctx{0, k0, enc_row, enc_col, row_tab ? tab[0] : nullptr,
                                        col_tab ? tab[1] : nullptr};
        if constexpr (kRow != kNvfp4 && kCol != kNvfp4) {
          quantize::QuantizeTilesPrefetched<In, kRow, kCol, kPlain, false>(q, ctx, mt0, mt1);  // ends with a barrier
        } else if constexpr (quantize::kStagedPairing<In, kRow, kCol, false>) {
          quantize::QuantizeTilesStaged<In, kRow, kCol, kPlain, false>(q, ctx, mt0, mt1);  // ends with a barrier
        } else {
          for (int64_t mt = mt0; mt < mt1; ++mt) {
            quantize::QuantizeTile<In, kRow, kCol, kPlain>(q, ctx, mt);
            __syncthreads();  // the tile's shared memory is reused by the next tile / unit
          }
        }
      } else {
        const int64_t b = lu * kThreads + threadIdx.x;
        if constexpr (kRow == kNvfp4) GenericNvfp4<In>(a, t, g, b, false, row_opts, a.row_data, a.row_scale);
        if constexpr (kRow == kMxfp8E4m3 || kRow == kMxfp8E5m2) {
          GenericMxfp8<In, kRow>(a, t, g, b, false, a.row_data, a.row_scale);
        }
        if constexpr (kCol == kNvfp4) GenericNvfp4<In>(a, t, g, b, true, col_opts, a.col_data, a.col_scale);
        if constexpr (kCol == kMxfp8E4m3 || kCol == kMxfp8E5m2) {
          GenericMxfp8<In, kCol>(a, t, g, b, true, a.col_data, a.col_scale);
        }
      }
    }
    // Two slots: a thread still reading slot p of this unit is past this barrier before thread 0 writes p again (two
    // units on, after the next unit's barrier).
    if (threadIdx.x == 0) claimed_smem[parity] = claimed;
    __syncthreads();
    u = int64_t(gridDim.x) + claimed_smem[parity];
  }
}

// Host-side launch of one pairing (persistent grid; the options-free NVFP4 kernels use the tile routine's plain
// variant); *a.work must be 0 (a cudaMemsetAsync before the launch). Shared by the FFI handler and
// tools/dev/kernel_check/grouped_check.cu.
template <typename In, int kRow, int kCol>
cudaError_t LaunchQuantize(const QuantArgs& a, cudaStream_t stream) {
  static_assert(kRow != kNone || kCol != kNone, "no orientation");
  const size_t smem = TableBytes(a.n);
  unsigned grid = 0;
  cudaError_t err;
  if constexpr (kRow == kNvfp4 || kCol == kNvfp4) {
    if (a.row_opts == 0 && a.col_opts == 0) {
      err = PersistentGrid(GroupedQuantizeKernel<In, kRow, kCol, true>, smem, &grid);
      if (err != cudaSuccess) return err;
      GroupedQuantizeKernel<In, kRow, kCol, true><<<grid, kThreads, smem, stream>>>(a);
      return cudaGetLastError();
    }
  }
  err = PersistentGrid(GroupedQuantizeKernel<In, kRow, kCol, false>, smem, &grid);
  if (err != cudaSuccess) return err;
  GroupedQuantizeKernel<In, kRow, kCol, false><<<grid, kThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace grouped
}  // namespace jax_fp4
