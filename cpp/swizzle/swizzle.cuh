// GEMM-swizzled block-scale layout (docs/numerics.md section 3): compact S[rows, cols] <-> padded, swizzled [Rp, Cp].
//
// Rp = round_up(rows, 128), Cp = round_up(cols, 4). The padded matrix is cut into 128x4 tiles of 512 contiguous
// bytes (tiles in row-major order); inside a tile, S[i, j] sits at (i % 32) * 16 + ((i % 128) / 32) * 4 + (j % 4).
// So the 16 bytes at tile offset 16 * l are the four rows l, l + 32, l + 64, l + 96, four columns each.
//
// Both kernels move a 128-row x 64-column stripe (16 tiles, 8 KiB) per 256-thread block through shared memory:
// the compact side as rows of 4-byte words (4-byte accesses when cols % 4 == 0 and the pointers are aligned, else
// byte accesses), the swizzled side as 16-byte chunks (always aligned: a matrix is a multiple of 512 bytes). Leading
// batch dimensions are independent matrices, one after the other in both layouts. Padding is written as zero bytes
// (E4M3 +0, E8M0 code 0) by the swizzle kernel itself. No atomics, no scratch: command-buffer safe. Included by
// swizzle_ffi.cu only (it defines the kernels); other kernels take the index formula from common/scale_layout.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/scale_layout.cuh"

namespace jax_fp4 {
namespace swizzle {

using layout::kTileBytes;
using layout::kTileCols;
using layout::kTileRows;
constexpr int kStripeTiles = 16;                   // tiles per thread block
constexpr int kWords = kStripeTiles;               // 4-byte words per stripe row (one per tile)
constexpr int kPitch = kWords + 1;                 // shared-memory row pitch in words (odd: no bank conflicts)
constexpr int kThreads = 256;

struct Geometry {
  int64_t rows, cols;                // compact matrix
  int64_t rows_padded, cols_padded;  // swizzled matrix
  int64_t row_tiles;                 // rows_padded / 128
  int64_t stripes;                   // ceil(cols_padded / (4 * kStripeTiles)): column stripes per row tile
  bool word_aligned;                 // compact rows may be accessed as 4-byte words
};

// Block index -> (matrix b, row tile, stripe).
__device__ __forceinline__ void StripeOf(const Geometry& g, int64_t& b, int64_t& rt, int64_t& st) {
  int64_t blk = blockIdx.x;
  st = blk % g.stripes;
  blk /= g.stripes;
  rt = blk % g.row_tiles;
  b = blk / g.row_tiles;
}

// Compact word (4 columns from col) of row `row`, zero past the matrix (the padding).
__device__ __forceinline__ uint32_t LoadWord(const uint8_t* __restrict__ m, const Geometry& g, int64_t row,
                                             int64_t col) {
  if (row >= g.rows || col >= g.cols) return 0u;
  const uint8_t* p = m + row * g.cols + col;
  if (g.word_aligned) return __ldg(reinterpret_cast<const uint32_t*>(p));  // cols % 4 == 0: the word is whole
  uint32_t v = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (col + q < g.cols) v |= uint32_t(__ldg(p + q)) << (8 * q);
  }
  return v;
}

__device__ __forceinline__ void StoreWord(uint8_t* __restrict__ m, const Geometry& g, int64_t row, int64_t col,
                                          uint32_t v) {
  if (row >= g.rows || col >= g.cols) return;
  uint8_t* p = m + row * g.cols + col;
  if (g.word_aligned) {
    *reinterpret_cast<uint32_t*>(p) = v;
    return;
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (col + q < g.cols) p[q] = uint8_t(v >> (8 * q));
  }
}

// compact [B, rows, cols] -> swizzled [B, Rp, Cp]; grid: B * row_tiles * stripes blocks.
__global__ void __launch_bounds__(kThreads) SwizzleKernel(const uint8_t* __restrict__ in, uint8_t* __restrict__ out,
                                                          const Geometry g) {
  __shared__ uint32_t tile[kTileRows * kPitch];
  int64_t b, rt, st;
  StripeOf(g, b, rt, st);
  const uint8_t* src = in + b * g.rows * g.cols;
  const int64_t r0 = rt * kTileRows, c0 = st * kStripeTiles * kTileCols;
  for (int k = threadIdx.x; k < kTileRows * kWords; k += kThreads) {
    const int r = k / kWords, w = k % kWords;
    tile[r * kPitch + w] = LoadWord(src, g, r0 + r, c0 + 4 * w);
  }
  __syncthreads();
  const int64_t tiles_left = (g.cols_padded >> 2) - st * kStripeTiles;
  const int tiles = tiles_left < kStripeTiles ? int(tiles_left) : kStripeTiles;
  uint4* dst = reinterpret_cast<uint4*>(out + b * g.rows_padded * g.cols_padded +
                                        (rt * (g.cols_padded >> 2) + st * kStripeTiles) * kTileBytes);
  for (int q = threadIdx.x; q < tiles * 32; q += kThreads) {  // chunk q: tile q / 32, rows l + 32k (l = q % 32)
    const int t = q >> 5, l = q & 31;
    dst[q] = make_uint4(tile[l * kPitch + t], tile[(l + 32) * kPitch + t], tile[(l + 64) * kPitch + t],
                        tile[(l + 96) * kPitch + t]);
  }
}

// swizzled [B, Rp, Cp] -> compact [B, rows, cols] (the padding is dropped); same grid.
__global__ void __launch_bounds__(kThreads) UnswizzleKernel(const uint8_t* __restrict__ in,
                                                            uint8_t* __restrict__ out, const Geometry g) {
  __shared__ uint32_t tile[kTileRows * kPitch];
  int64_t b, rt, st;
  StripeOf(g, b, rt, st);
  const int64_t tiles_left = (g.cols_padded >> 2) - st * kStripeTiles;
  const int tiles = tiles_left < kStripeTiles ? int(tiles_left) : kStripeTiles;
  const uint4* src = reinterpret_cast<const uint4*>(in + b * g.rows_padded * g.cols_padded +
                                                    (rt * (g.cols_padded >> 2) + st * kStripeTiles) * kTileBytes);
  for (int q = threadIdx.x; q < tiles * 32; q += kThreads) {
    const int t = q >> 5, l = q & 31;
    const uint4 v = __ldg(src + q);
    tile[l * kPitch + t] = v.x;
    tile[(l + 32) * kPitch + t] = v.y;
    tile[(l + 64) * kPitch + t] = v.z;
    tile[(l + 96) * kPitch + t] = v.w;
  }
  __syncthreads();
  uint8_t* dst = out + b * g.rows * g.cols;
  const int64_t r0 = rt * kTileRows, c0 = st * kStripeTiles * kTileCols;
  for (int k = threadIdx.x; k < kTileRows * kWords; k += kThreads) {
    const int r = k / kWords, w = k % kWords;
    if (w < tiles) StoreWord(dst, g, r0 + r, c0 + 4 * w, tile[r * kPitch + w]);
  }
}

// ---- host side ----------------------------------------------------------------------------------------------
// `compact` is the compact matrix's pointer (its alignment decides word access); launches return cudaSuccess
// without launching when there is nothing to do.
inline Geometry MakeGeometry(int64_t rows, int64_t cols, const void* compact) {
  Geometry g{};
  g.rows = rows;
  g.cols = cols;
  g.rows_padded = (rows + kTileRows - 1) / kTileRows * kTileRows;
  g.cols_padded = (cols + kTileCols - 1) / kTileCols * kTileCols;
  g.row_tiles = g.rows_padded / kTileRows;
  g.stripes = (g.cols_padded / kTileCols + kStripeTiles - 1) / kStripeTiles;
  g.word_aligned = cols % 4 == 0 && reinterpret_cast<uintptr_t>(compact) % 4 == 0;
  return g;
}

inline int64_t NumBlocks(int64_t batch, const Geometry& g) { return batch * g.row_tiles * g.stripes; }

inline cudaError_t LaunchSwizzle(const uint8_t* in, uint8_t* out, int64_t batch, const Geometry& g,
                                 cudaStream_t stream) {
  const int64_t blocks = NumBlocks(batch, g);
  if (blocks == 0) return cudaSuccess;
  SwizzleKernel<<<unsigned(blocks), kThreads, 0, stream>>>(in, out, g);
  return cudaGetLastError();
}

inline cudaError_t LaunchUnswizzle(const uint8_t* in, uint8_t* out, int64_t batch, const Geometry& g,
                                   cudaStream_t stream) {
  if (g.rows * g.cols == 0) return cudaSuccess;
  const int64_t blocks = NumBlocks(batch, g);
  if (blocks == 0) return cudaSuccess;
  UnswizzleKernel<<<unsigned(blocks), kThreads, 0, stream>>>(in, out, g);
  return cudaGetLastError();
}

}  // namespace swizzle
}  // namespace jax_fp4
