// Per-group NVFP4 tensor amax of a grouped buffer (docs/numerics.md sections 1 and 4), exactly as
// jax_fp4.reference.grouped computes it before the quantize: the fmax-reduction of |y| over every 16-block of the
// group's internal (oriented) order, y after the RHT for RHT formats.
//
// The reference builds a group's blocks from its oriented elements at local indices 0 .. round_up(M_g K_g, 16) - 1,
// reading source element offsets[g] + local (rowwise) / offsets[g] + o2c(local) (columnwise) from x, bounded only by
// the buffer. For an aligned group that is exactly its elements; a misaligned group's last block also reads a few
// elements past the group (the next group's), and this kernel reads the same ones, so the amax (hence the codes)
// match bit for bit.
//
// Work unit: 4 64x64 tiles of an aligned group for the columnwise RHT amax (AmaxTilePath / AmaxTiles), else
// 4 x 256 consecutive 16-blocks (chunks) of one group; thread t owns chunks t, t + 256, ...:
//  * the flat chunk x[off + 16 j, off + 16 j + 16): the rowwise block (RHT: transformed) and, for the columnwise
//    amax without RHT, the group's elements (a max is order-free), plus the columnwise padding of a misaligned
//    group in its last chunk;
//  * columnwise with RHT: the 16x1 column segment (column j % K_g, rows 16 (j / K_g) ...), adjacent threads on
//    adjacent columns (coalesced); a misaligned group gathers its oriented blocks through o2c.
// The block maxima meet in one atomicMax per run of a block's units of one group (see the kernel) and orientation on
// the fp32 bit patterns (non-negative, NaN ignored as fmaxf does) into a zeroed float32[2N] scratch (row amaxes, then
// column amaxes).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/convert.cuh"
#include "grouped/group_table.cuh"
#include "quantize/quantize.cuh"

namespace jax_fp4 {
namespace grouped {

struct AmaxArgs {
  const void* x;
  int64_t size;
  int n;
  const int32_t* first_dims;  // [N]
  const int32_t* last_dims;   // [N]
  uint32_t* amax_bits;        // [2N], zeroed: fp32 patterns of the row, then the column amaxes
  bool row, col;              // NVFP4 orientations present
  bool row_rht, col_rht;
};

constexpr int kAmaxUnroll = 4;  // chunks per thread and unit (independent loads in flight)
constexpr int kAmaxTilesPerUnit = 4;  // 64x64 tiles per tile-path unit, down the rows

// Tile path: the columnwise RHT amax of a group whose columns split into whole 16-row segments (M_g % 16 == 0), inside
// the buffer, with whole rowwise blocks (K_g % 16 == 0) if the rowwise amax is wanted too. Its 64x64 tiles are read
// as row segments (16-byte loads where aligned) and transposed through shared memory, as the single-tensor RHT amax
// kernel does, instead of every thread gathering a 16x1 column segment with 16 scalar loads (about twice as fast
// with the ftz forward RHT of common/convert.cuh: docs/kernels/grouped.md).
__device__ __forceinline__ bool AmaxTilePath(const AmaxArgs& a, const Table& t, int g) {
  return a.col && a.col_rht && t.rows[g] % 16 == 0 && (!a.row || t.cols[g] % 16 == 0) && t.Inside(g);
}

__device__ __forceinline__ int64_t AmaxUnits(const AmaxArgs& a, const Table& t, int g) {
  if (g >= t.n || t.Count(g) == 0) return 0;
  if (AmaxTilePath(a, t, g)) return CeilDiv(CeilDiv(t.rows[g], 64), kAmaxTilesPerUnit) * CeilDiv(t.cols[g], 64);
  return CeilDiv(CeilDiv(t.Count(g), 16), int64_t(kThreads) * kAmaxUnroll);
}

template <typename In>
__device__ __forceinline__ float LoadOr0(const In* x, int64_t i, int64_t size) {
  return i < size ? quantize::ToFloat<In>(x[i]) : 0.0f;
}

// Max-accumulates the rowwise amax of one 16-element block v into *row (of its RHT for RHT formats; v is kept).
__device__ __forceinline__ void RowBlockAmax(const AmaxArgs& a, const float (&v)[16], float* row) {
  if (a.row_rht) {
    float w[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i] = v[i];
    cvt::RhtForward16(w);
    *row = fmaxf(*row, quantize::Max16(w));
  } else {
    *row = fmaxf(*row, quantize::Max16(v));
  }
}

// Max-accumulates chunk j (< chunks) of group g into *row / *col.
template <typename In>
__device__ __forceinline__ void AmaxChunk(const AmaxArgs& a, const In* x, int64_t off, int64_t cnt, int64_t m,
                                          int64_t k, int64_t j, int64_t chunks, float* row, float* col) {
  if (a.row || (a.col && !a.col_rht)) {
    const int64_t s0 = off + 16 * j, left = a.size - s0;
    const bool vector = reinterpret_cast<uintptr_t>(x + off) % 16 == 0;
    float v[16];
    quantize::Load16<In>(x + s0, left < 16 ? int(left) : 16, vector, v);
    if (a.row) RowBlockAmax(a, v, row);  // a misaligned group's last chunk: the reference's padding too
    if (a.col && !a.col_rht) {
      const int64_t in_group = cnt - 16 * j;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        if (i < in_group) *col = cvt::AbsMax(*col, v[i]);
      }
      if (m % 16 != 0 && j == chunks - 1) {  // the columnwise padding of a misaligned group
        for (int64_t l = cnt; l < chunks * 16; ++l) *col = cvt::AbsMax(*col, LoadOr0(x, off + O2C(l, m, k), a.size));
      }
    }
  }
  if (a.col && a.col_rht) {
    float w[16];
    if (m % 16 == 0) {  // the 16x1 segment: column j % K_g, rows 16 (j / K_g) ...
      const uint32_t q = uint32_t(j) / uint32_t(k);  // j < 2^27, 0 < k < 2^31
      const int64_t c = uint32_t(j) - q * uint32_t(k), r0 = int64_t(q) * 16;
#pragma unroll
      for (int i = 0; i < 16; ++i) w[i] = LoadOr0(x, off + (r0 + i) * k + c, a.size);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) w[i] = LoadOr0(x, off + O2C(16 * j + i, m, k), a.size);
    }
    cvt::RhtForward16(w);
    *col = fmaxf(*col, quantize::Max16(w));
  }
}

// Tile-path unit lu of group g (off, m, k: its offset and dims): tiles [4 mb, 4 mb + 4) of the 64 columns from k0,
// lu = mb * ceil(k / 64) + k0 / 64. Thread (lr, cg) loads row segment [m0 + lr, k0 + 16 cg, +16) (zeros past the
// group: a partial last segment or rows of the next group), takes its rowwise amax, and stages it; thread (lc, rb)
// then transforms column segment [m0 + 16 rb, +16) x column k0 + lc (whole: M_g % 16 == 0; zeros past the group
// transform to zeros). The same 16 values in the same order as AmaxChunk's, so the same maxima. Called by all threads
// of the block (barriers inside).
template <typename In>
__device__ __forceinline__ void AmaxTiles(const AmaxArgs& a, const In* x, int64_t off, int64_t m, int64_t k,
                                          int64_t lu, float* row, float* col) {
  constexpr int kTile = quantize::kTile;
  __shared__ float tile[kTile][kTile + 1];
  const uint32_t k_tiles = uint32_t(CeilDiv(k, kTile)), mb = uint32_t(lu) / k_tiles;
  const int64_t k0 = int64_t(uint32_t(lu) - mb * k_tiles) * kTile, m_tiles = CeilDiv(m, kTile);
  const int64_t mt0 = int64_t(mb) * kAmaxTilesPerUnit;
  const int64_t mt1 = mt0 + kAmaxTilesPerUnit < m_tiles ? mt0 + kAmaxTilesPerUnit : m_tiles;
  const int t = int(threadIdx.x), lr = t >> 2, cg = t & 3, lc = t & 63, rb = t >> 6;
  const bool vector = reinterpret_cast<uintptr_t>(x + off) % 16 == 0 && (k * int64_t(sizeof(In))) % 16 == 0;
  const int64_t kk = k0 + cg * 16;
  for (int64_t mt = mt0; mt < mt1; ++mt) {  // uniform trip count
    const int64_t r = mt * kTile + lr;
    const int valid = r < m && kk < k ? int(k - kk < 16 ? k - kk : 16) : 0;
    float v[16];
    quantize::Load16<In>(x + off + r * k + kk, valid, vector, v);
    if (a.row) RowBlockAmax(a, v, row);
#pragma unroll
    for (int i = 0; i < 16; ++i) tile[lr][cg * 16 + i] = v[i];
    __syncthreads();
    float c[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) c[i] = tile[rb * 16 + i][lc];
    cvt::RhtForward16(c);
    *col = fmaxf(*col, quantize::Max16(c));
    __syncthreads();  // the tile is reused by the next one
  }
}

template <typename In>
__global__ void __launch_bounds__(kThreads) GroupedAmaxKernel(const AmaxArgs a) {
  extern __shared__ int32_t table_smem[];
  Table t = CarveTable(table_smem, a.n, a.size);
  BuildTable(t, a.first_dims, a.last_dims, [&a](const Table& tt, int g) { return AmaxUnits(a, tt, g); });
  const In* x = static_cast<const In*>(a.x);
  // Running maxima of the group `acc_g` over this block's units, published (block reduction + one atomicMax per
  // orientation) when the next unit belongs to another group or the block is done: the blocks' consecutive units
  // mostly share a group, so loads are not held up by a reduction after every unit. g is uniform over the block.
  float row = 0.0f, col = 0.0f;
  int acc_g = -1;
  for (int64_t u = blockIdx.x;; u += gridDim.x) {
    const bool more = u < t.Total();
    const int g = more ? FindGroup(t, int32_t(u)) : -1;
    if (acc_g >= 0 && g != acc_g) {
      const uint32_t rb = a.row ? BlockMaxBits(__float_as_uint(row)) : 0u;
      const uint32_t cb = a.col ? BlockMaxBits(__float_as_uint(col)) : 0u;
      if (threadIdx.x == 0) {
        if (rb != 0u) atomicMax(a.amax_bits + acc_g, rb);
        if (cb != 0u) atomicMax(a.amax_bits + a.n + acc_g, cb);
      }
      row = 0.0f, col = 0.0f;
    }
    if (!more) break;
    acc_g = g;
    const int64_t off = t.off[g], cnt = t.Count(g), m = t.rows[g], k = t.cols[g];
    if (AmaxTilePath(a, t, g)) {  // uniform over the block
      AmaxTiles<In>(a, x, off, m, k, u - t.units[g], &row, &col);
      continue;
    }
    const int64_t chunks = CeilDiv(cnt, 16);
#pragma unroll
    for (int r = 0; r < kAmaxUnroll; ++r) {
      const int64_t j = ((u - t.units[g]) * kAmaxUnroll + r) * kThreads + threadIdx.x;
      if (j < chunks) AmaxChunk<In>(a, x, off, cnt, m, k, j, chunks, &row, &col);
    }
  }
}

// Host-side launch (persistent grid); a.amax_bits must be zeroed first.
template <typename In>
cudaError_t LaunchAmax(const AmaxArgs& a, cudaStream_t stream) {
  const size_t smem = TableBytes(a.n);
  unsigned grid = 0;
  const cudaError_t err = PersistentGrid(GroupedAmaxKernel<In>, smem, &grid);
  if (err != cudaSuccess) return err;
  GroupedAmaxKernel<In><<<grid, kThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace grouped
}  // namespace jax_fp4
