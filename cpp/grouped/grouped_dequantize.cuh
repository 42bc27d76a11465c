// Grouped (MoE) dequantize: every group of one orientation's grouped data + scales back to f32 / bf16 / f16 in ONE
// persistent launch (docs/numerics.md section 4), bit-exact to jax_fp4.reference.grouped.dequantize_groups.
//
// Scheduling as grouped_quantize.cuh (group_table.cuh), with the output tail (positions past the last group) zeroed:
//  * Tile path (aligned group, 16-aligned offset, inside the buffer): the single-tensor decode routine
//    dequantize::DecodeSegment on a dequantize::Args describing the group as a [1, R, C] tensor (data / scales offset
//    to the group, its amax). Stored layouts that keep x's layout (NVFP4 rowwise, MXFP8 both orientations) run
//    kRuns x 256 segments of 16 elements per unit: each thread decodes its kRuns segments (all loads issued) before
//    its first store, so more bytes are in flight (the single-tensor FlatKernel's idea); NVFP4 columnwise (stored
//    x_g.T) runs kTilesPerUnit of the single-tensor transposed kernel's 128x64 tiles per unit with its per-variant
//    decodes (TransposedTile: plain or inverse RHT, each in an instantiation of its own). raw (the GEMM emulation's
//    operand value(q) * s_b) is the single-tensor kBlockOnly mode, without the inverse RHT.
//  * Generic path (misaligned traced groups and their successors): one thread per internal block of the group's
//    oriented order, reading codes and the scale slot exactly where the reference does (bounded by the buffers).
// Every output element is written exactly once; no atomics, no scratch (CUDA-graph safe).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/convert.cuh"
#include "dequantize/dequantize.cuh"
#include "dequantize/transpose.cuh"
#include "grouped/group_table.cuh"

namespace jax_fp4 {
namespace grouped {

struct DequantArgs {
  const uint8_t* data;   // [size] codes (NVFP4 packed two per byte, even index in the low nibble)
  const uint8_t* scale;  // [size / block] compact scales, group g at offsets[g] / block
  const float* amax;     // [N] NVFP4 tensor amax (null for MXFP8 and raw)
  void* out;             // [size]
  int64_t size;
  int n;
  const int32_t* first_dims;  // [N]
  const int32_t* last_dims;   // [N]
  bool col;  // columnwise (axis 0): NVFP4 data is x_g.T, MXFP8 scales [M_g / 32, K_g]
  bool rht;  // NVFP4 RHT (inverse applied unless raw)
  bool raw;  // NVFP4 value(q) * s_b, no tensor scale, no inverse RHT
  bool bound256;  // NVFP4 tensor scales on the E4M3 bound 256 (4over6): amax * fp32(1/1536)
};

constexpr int kRuns = 2;  // segments per thread and unit (tile path, row-major layouts): 47 registers for 16-bit outputs
// NVFP4 columnwise: TransposedTile tiles per unit (consecutive in the group's tile order), so that the unit's set-up
// (group search, the group's Args) is paid once per 4 tiles (up to 9 % faster than one tile a unit; the row-major
// layouts keep one batch of segments a unit: docs/kernels/grouped.md).
constexpr int kTilesPerUnit = 4;

template <int kKind>
__device__ __forceinline__ bool DequantTilePath(const DequantArgs& a, const Table& t, int g) {
  constexpr int bs = kKind == dequantize::kNvfp4 ? 16 : 32;
  return t.off[g] % 16 == 0 && t.Inside(g) && (a.col ? t.rows[g] : t.cols[g]) % bs == 0;
}

// kTiles: kNoTiles, or the dequantize::TransposeVariant (plain / RHT) whose TransposedTile runs NVFP4 columnwise
// calls of that variant (other calls take the float tile, so any call is decoded right by any instantiation).
constexpr int kNoTiles = -1;

template <int kTiles>
__device__ __forceinline__ bool UseTransposedTile(const DequantArgs& a) {
  return kTiles != kNoTiles && (a.rht && !a.raw) == (kTiles == dequantize::kTransposeRht);
}

template <int kKind, int kTiles>
__device__ __forceinline__ int64_t DequantUnits(const DequantArgs& a, const Table& t, int g) {
  constexpr int bs = kKind == dequantize::kNvfp4 ? 16 : 32;
  if (g == t.n) return CeilDiv(t.size - t.off[t.n], int64_t(kThreads) * 16);
  const int64_t cnt = t.Count(g), m = t.rows[g], k = t.cols[g];
  if (cnt == 0) return 0;
  if (!DequantTilePath<kKind>(a, t, g)) return CeilDiv(CeilDiv(cnt, bs), kThreads);
  if (kKind == dequantize::kNvfp4 && a.col) {
    if (!UseTransposedTile<kTiles>(a)) return CeilDiv(k, dequantize::kTile) * CeilDiv(m, dequantize::kTile);
    return CeilDiv(CeilDiv(k, dequantize::kTR) * CeilDiv(m, dequantize::kTC), kTilesPerUnit);  // TransposedTile
  }
  return CeilDiv(m * CeilDiv(k, dequantize::kSeg), int64_t(kThreads) * kRuns);
}

// Output bits of a 16-element run: 16 words (float32) or 8 words of two 16-bit values (element 2i low).
template <typename Out>
__host__ __device__ constexpr int RunWords() { return sizeof(Out) == 4 ? 16 : 8; }

template <typename Out>
__device__ __forceinline__ void PackRun(const float (&v)[16], uint32_t (&w)[RunWords<Out>()]) {
#pragma unroll
  for (int i = 0; i < RunWords<Out>(); ++i) {
    w[i] = sizeof(Out) == 4 ? dequantize::OutBits<Out>(v[i])
                            : dequantize::OutBits<Out>(v[2 * i]) | (dequantize::OutBits<Out>(v[2 * i + 1]) << 16);
  }
}

// dequantize::Store16 of packed bits: 16-byte stores when `vector` and the run is whole, else the valid elements.
template <typename Out>
__device__ __forceinline__ void StoreRun(Out* dst, const uint32_t (&w)[RunWords<Out>()], int valid, bool vector) {
  if (vector && valid == 16) {
    uint4* d = reinterpret_cast<uint4*>(dst);
#pragma unroll
    for (int q = 0; q < RunWords<Out>() / 4; ++q) d[q] = make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
    return;
  }
  using Bits = typename std::conditional<sizeof(Out) == 4, uint32_t, uint16_t>::type;
  Bits* d = reinterpret_cast<Bits*>(dst);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    if (i < valid) d[i] = Bits(sizeof(Out) == 4 ? w[i] : w[i >> 1] >> (16 * (i & 1)));
  }
}

template <typename Out>
__device__ __forceinline__ void StoreOne(void* out, int64_t p, float v) {
  using Bits = typename std::conditional<sizeof(Out) == 4, uint32_t, uint16_t>::type;
  static_cast<Bits*>(out)[p] = Bits(dequantize::OutBits<Out>(v));
}

// Internal block b of group g, as the reference decodes it (codes / scale slots outside the buffers read as 0).
template <typename Out, int kKind>
__device__ __forceinline__ void GenericDequant(const DequantArgs& a, const Table& t, int g, int64_t b) {
  const int64_t off = t.off[g], cnt = t.Count(g), m = t.rows[g], k = t.cols[g], end = t.off[g + 1];
  if constexpr (kKind == dequantize::kNvfp4) {
    if (16 * b >= cnt) return;
    const int64_t si = off / 16 + b;
    const float s_b = cvt::E4M3Value(si < a.size / 16 ? a.scale[si] : 0u);
    const float f = a.raw ? s_b : cvt::Nvfp4DecodeScale(s_b, a.amax[g], a.bound256);
    float v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int64_t e = off + 16 * b + i;
      const uint32_t q = e < a.size ? (a.data[e >> 1] >> (4 * (e & 1))) & 0xFu : 0u;
      v[i] = __fmul_rn(dequantize::E2M1Value(q), f);
    }
    if (a.rht && !a.raw) dequantize::RhtInverse16(v);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int64_t l = 16 * b + i, p = off + (a.col ? O2C(l, m, k) : l);
      if (l < cnt && p < end) StoreOne<Out>(a.out, p, v[i]);
    }
  } else {
    if (32 * b >= cnt) return;
    const int64_t si = off / 32 + (a.col ? O2C(b, m / 32, k) : b);
    const float s = dequantize::E8M0Value(si < a.size / 32 ? a.scale[si] : 0u);
    for (int i = 0; i < 32; ++i) {
      const int64_t l = 32 * b + i;
      if (l >= cnt) break;
      const int64_t p = off + (a.col ? O2C(l, m, k) : l);
      if (p < end) {
        StoreOne<Out>(a.out, p, dequantize::MxDecode<kKind>(a.data[p], s, dequantize::OutMaxBits<Out>()));
      }
    }
  }
}

// NVFP4 columnwise, kVar = dequantize::kTransposePlain (1D / 2D, or raw) or kTransposeRht (inverse RHT): tile lt of
// the group is (lt / column tiles, lt % column tiles) of dequantize/transpose.cuh's 128 x 64 tiles of the stored
// [K_g, M_g] (d: the group as a [1, R, C] tensor, d.out = x_g), decoded by the single-tensor transposed kernel's
// per-variant routines (LoadRaw, the table / paired / RHT decodes) into `tile` and written as x_g rows with bounds
// checks. Ends with a barrier (the tile is reused by the next tile).
template <typename Out, int kVar>
__device__ __forceinline__ void TransposedTile(const dequantize::Args& d, int64_t lt, dequantize::PairOf<Out>* tile) {
  namespace dq = dequantize;
  using Bits = typename std::conditional<sizeof(Out) == 4, uint32_t, uint16_t>::type;
  constexpr int kV = 16 / int(sizeof(Out)), kPairs = dq::kTR / 2, kRunsPerRow = dq::kTR / kV;
  const uint32_t c_tiles = uint32_t(CeilDiv(d.C, dq::kTC)), rt = uint32_t(lt) / c_tiles;
  const dq::TilePos pos{0, 0, int(rt), 0, int(uint32_t(lt) - rt * c_tiles)};
  const int t = threadIdx.x, j = t >> 2, cg = t & 3;
  const dq::RawSegments raw = dq::LoadRaw<kVar>(d, pos, dq::ThreadOffsets(d, j, cg), j, cg);
  const float amax = dq::TensorAmax<kVar>(d, 0);
  const dq::SegmentScale sc[2] = {dq::ScaleOf<kVar>(d, raw, amax, 0), dq::ScaleOf<kVar>(d, raw, amax, 1)};
  const bool fast = dq::FastSegment<kVar>(sc[0]) && dq::FastSegment<kVar>(sc[1]);
  dq::PairOf<Out>* const mine = tile + cg * dq::kSeg * kPairs + (j ^ (cg << 3));
  if constexpr (kVar == dq::kTransposeRht) {
    dq::StoreRhtPairs<Out>(sc, fast, mine);
  } else if constexpr (sizeof(Out) == 2) {
    if (fast) dq::StoreTablePairs<Out>(sc, mine);
    else dq::StorePairs<Out, dq::kTransposePlain, false>(sc, mine);
  } else if (fast) {
    dq::StorePairs<Out, dq::kTransposePlain, true>(sc, mine);
  } else {
    dq::StorePairs<Out, dq::kTransposePlain, false>(sc, mine);
  }
  __syncthreads();
  const int64_t r0 = int64_t(pos.rt) * dq::kTR, c0 = int64_t(pos.ct) * dq::kTC;
  for (int q = t; q < dq::kTC * kRunsPerRow; q += kThreads) {  // x_g row c0 + orl, columns r0 + run * kV ..
    const int orl = q / kRunsPerRow, run = q % kRunsPerRow;
    const int64_t left = d.R - (r0 + run * kV);
    if (c0 + orl >= d.C || left <= 0) continue;
    const dq::PairOf<Out>* src = tile + orl * kPairs + ((run * (kV / 2)) ^ ((orl >> 4) << 3));
    Bits* dst = static_cast<Bits*>(d.out) + (c0 + orl) * d.R + r0 + run * kV;
    if (d.vector_out && left >= kV) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      const Bits* e = reinterpret_cast<const Bits*>(src);
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        if (i < left) dst[i] = e[i];
      }
    }
  }
  __syncthreads();
}

// kTiles: NVFP4 columnwise of that variant through TransposedTile (the launcher's choice for such calls: a
// separate instantiation, so the other layouts keep the registers and schedule of a kernel without it).
// Resident blocks per SM for the NVFP4 columnwise (TransposedTile) instantiations: the register budgets they had
// with one tile a unit (64 for 16-bit outputs, 80 for f32), which the multi-tile units would otherwise exceed (80
// registers for RHT bf16). 0 (no bound) for the others: the same registers and code as before.
template <typename Out, int kTiles>
__host__ __device__ constexpr int DequantMinBlocks() {
  return kTiles == kNoTiles ? 0 : (sizeof(Out) == 2 ? 4 : 3);
}

template <typename Out, int kKind, int kTiles>
__global__ void __launch_bounds__(kThreads, DequantMinBlocks<Out, kTiles>())
    GroupedDequantizeKernel(const DequantArgs a) {
  constexpr bool kNv = kKind == dequantize::kNvfp4;
  constexpr int bs = kNv ? 16 : 32;
  // NVFP4 columnwise: the float tile, or with kTiles TransposedTile's output pairs (one buffer, the larger size)
  constexpr int kFloatTile = dequantize::kTile * (dequantize::kTile + 1) * 4;
  constexpr int kPairTile = dequantize::kTC * dequantize::kTR / 2 * int(sizeof(dequantize::PairOf<Out>));
  __shared__ __align__(16) uint8_t tile_smem[kNv ? (kTiles != kNoTiles && kPairTile > kFloatTile ? kPairTile : kFloatTile)
                                                 : 16];
  auto tile = reinterpret_cast<float(*)[dequantize::kTile + 1]>(tile_smem);
  extern __shared__ int32_t table_smem[];
  Table t = CarveTable(table_smem, a.n, a.size);
  BuildTable(t, a.first_dims, a.last_dims,
             [&a](const Table& tt, int g) { return DequantUnits<kKind, kTiles>(a, tt, g); });
  Out* out = static_cast<Out*>(a.out);
  for (int64_t u = blockIdx.x; u < t.Total(); u += gridDim.x) {
    const int g = FindGroup(t, int32_t(u));  // uniform over the block
    const int64_t lu = u - t.units[g];
    if (g == t.n) {  // zero the positions past the last group
      const int64_t p0 = t.off[t.n] + (lu * kThreads + threadIdx.x) * 16;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        if (p0 + i < a.size) StoreOne<Out>(a.out, p0 + i, 0.0f);
      }
      continue;
    }
    if (!DequantTilePath<kKind>(a, t, g)) {
      GenericDequant<Out, kKind>(a, t, g, lu * kThreads + threadIdx.x);
      continue;
    }
    const int64_t off = t.off[g], m = t.rows[g], k = t.cols[g];
    const bool transposed = kNv && a.col;
    dequantize::Args d{};
    d.data = a.data + (kNv ? off / 2 : off);
    d.scale = a.scale + off / bs;
    d.amax = kNv && !a.raw ? a.amax + g : nullptr;
    d.P = 1;
    d.R = transposed ? k : m;
    d.C = transposed ? m : k;
    d.segs_per_row = CeilDiv(d.C, dequantize::kSeg);
    d.scale_cols_padded = 0;
    d.flags = (kNv && a.rht && !a.raw ? dequantize::kRht : 0) | (!kNv && a.col ? dequantize::kMxColumnwise : 0) |
              (kNv && a.raw ? dequantize::kBlockOnly : 0) | (kNv && a.bound256 ? dequantize::kBound256 : 0);
    d.vector_data = d.C % dequantize::kSeg == 0 && reinterpret_cast<uintptr_t>(d.data) % (kNv ? 8 : 16) == 0 &&
                    (kNv || !a.col || reinterpret_cast<uintptr_t>(d.scale) % 16 == 0);
    Out* og = out + off;  // x_g [M_g, K_g]
    const bool vector_out = (k * int64_t(sizeof(Out))) % 16 == 0 && reinterpret_cast<uintptr_t>(og) % 16 == 0;
    if constexpr (kNv) {
      if constexpr (kTiles != kNoTiles) {
        if (transposed && UseTransposedTile<kTiles>(a)) {
          d.out = og;
          d.vector_out = vector_out;
          const int64_t tiles = CeilDiv(d.R, dequantize::kTR) * CeilDiv(d.C, dequantize::kTC);
          const int64_t lt1 = (lu + 1) * kTilesPerUnit < tiles ? (lu + 1) * kTilesPerUnit : tiles;
          for (int64_t lt = lu * kTilesPerUnit; lt < lt1; ++lt) {  // uniform over the block
            TransposedTile<Out, kTiles>(d, lt, reinterpret_cast<dequantize::PairOf<Out>*>(tile_smem));
          }
          continue;
        }
      }
      if (transposed) {  // stored [K_g, M_g] -> x_g [M_g, K_g] through a float tile in shared memory
        const uint32_t c_tiles = uint32_t(CeilDiv(d.C, dequantize::kTile)), rt = uint32_t(lu) / c_tiles;
        const int64_t r0 = int64_t(rt) * dequantize::kTile;
        const int64_t c0 = int64_t(uint32_t(lu) - rt * c_tiles) * dequantize::kTile;
        const int lr = threadIdx.x >> 2, cg = threadIdx.x & 3;
        float v[16];
        if (r0 + lr < d.R && c0 + cg * 16 < d.C) {
          dequantize::DecodeSegment<dequantize::kNvfp4>(d, r0 + lr, c0 + cg * 16, 16, v,
                                                        dequantize::OutMaxBits<Out>());
        } else {
#pragma unroll
          for (int i = 0; i < 16; ++i) v[i] = 0.0f;
        }
#pragma unroll
        for (int i = 0; i < 16; ++i) tile[cg * 16 + i][lr] = v[i];
        __syncthreads();
        const int64_t orow = c0 + lr, ocol = r0 + cg * 16;  // x_g row (a stored column), 16 x_g columns
        if (orow < d.C && ocol < d.R) {
#pragma unroll
          for (int i = 0; i < 16; ++i) v[i] = tile[lr][cg * 16 + i];
          const int64_t left = d.R - ocol;
          dequantize::Store16<Out>(og + orow * d.R + ocol, v, left < 16 ? int(left) : 16, vector_out);
        }
        __syncthreads();  // the tile is reused by the next unit
        continue;
      }
    }
    // Segment j of this unit: lu * kRuns * 256 + j * 256 + thread (< 2^31: segments of one group), so each j is a
    // contiguous warp access. The decoded runs are held as output bits (8 or 16 words) until the stores.
    const int64_t segs = d.R * d.segs_per_row;
    const uint32_t spr = uint32_t(d.segs_per_row);
    uint32_t w[kRuns][RunWords<Out>()];
    int64_t dst[kRuns];
    int valid[kRuns];
#pragma unroll
    for (int j = 0; j < kRuns; ++j) {
      const uint32_t seg = (uint32_t(lu) * kRuns + j) * kThreads + threadIdx.x;
      valid[j] = 0;
      dst[j] = 0;
      if (seg < segs) {
        const uint32_t row = seg / spr;
        const int64_t c = int64_t(seg - row * spr) * dequantize::kSeg;
        const int64_t left = d.C - c;
        valid[j] = left < dequantize::kSeg ? int(left) : dequantize::kSeg;
        dst[j] = row * d.C + c;
        float v[16];
        dequantize::DecodeSegment<kKind>(d, row, c, valid[j], v, dequantize::OutMaxBits<Out>());
        PackRun<Out>(v, w[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kRuns; ++j) {
      if (valid[j] > 0) StoreRun<Out>(og + dst[j], w[j], valid[j], vector_out);
    }
  }
}

}  // namespace grouped
}  // namespace jax_fp4
