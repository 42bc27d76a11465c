// MXFP8 columnwise data (blocks of 32 along R) with GEMM-swizzled scales -> f32 / bf16 / f16 (docs/numerics.md sections
// 1 and 3), bit-exact to jax_fp4.reference.
//
// The swizzled scale of element (p, r, c) is S[p * C + c, r / 32] of the padded [Rp, Cp] matrix: the 16 scales of a
// 16-column run lie 16 bytes apart, so reading them per run costs 16 byte loads. Here a 256-thread block owns a tile
// of 128 rows (4 scale columns) x 128 columns: it first copies the tile's 4 x 128 scales into shared memory (compact,
// column-major per scale column; when they form one whole 512-byte swizzled tile, as for P == 1 or C % 128 == 0,
// with one 4-byte load per thread of the first 128) and issues its data loads, then each thread decodes four
// 16-column runs (rows r0 + 32 m + t / 8, m < 4: run m uses scale column m), reading the run's 16 scales as one
// 16-byte shared load.
// Used when C % 16 == 0 and data and output rows are 16-byte aligned (Args::vector_data / vector_out); R % 32 == 0 as
// for every MXFP8 columnwise tensor. Grid: P * ceil(R / 128) * ceil(C / 128) blocks. No atomics, no scratch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/scale_layout.cuh"
#include "dequantize/args.cuh"
#include "dequantize/decode.cuh"

namespace jax_fp4 {
namespace dequantize {

constexpr int kMxTileRows = 128, kMxTileCols = 128;

template <typename Out, int kKind>
__global__ void __launch_bounds__(kThreads) MxColumnwiseSwizzledKernel(const Args a, int64_t row_tiles,
                                                                       int64_t col_tiles) {
  constexpr int kScaleCols = kMxTileRows / 32, kRunsPerRow = kMxTileCols / kSeg, kRowsPerPass = kThreads / kRunsPerRow;
  static_assert(kRowsPerPass == 32, "one pass per scale column");
  __shared__ __align__(16) uint8_t scales[kScaleCols][kMxTileCols];
  const int64_t R = a.R, C = a.C;
  int64_t blk = blockIdx.x;
  const int64_t ct = blk % col_tiles;
  blk /= col_tiles;
  const int64_t rt = blk % row_tiles, p = blk / row_tiles;
  const int64_t r0 = rt * kMxTileRows, c0 = ct * kMxTileCols;
  const int t = threadIdx.x;
  if (a.P == 1 || C % kMxTileCols == 0) {
    // The tile's scales are one whole 512-byte swizzled tile (scale rows p * C + c0 .. + 127, a multiple of 128;
    // scale columns r0 / 32 .. + 3): thread t < 128 loads its 4 bytes at 4 t, scale row (t / 4) + 32 (t % 4),
    // columns m = 0..3. Rows or columns past the tensor hold the padding and are not decoded.
    if (t < kMxTileCols) {
      const int64_t tile = ((p * C + c0) >> 7) * (a.scale_cols_padded >> 2) + (r0 >> 7);
      const uint32_t w = __ldg(reinterpret_cast<const uint32_t*>(a.scale + tile * layout::kTileBytes) + t);
      const int i = (t >> 2) + 32 * (t & 3);
#pragma unroll
      for (int m = 0; m < kScaleCols; ++m) scales[m][i] = uint8_t(w >> (8 * m));
    }
  } else {
#pragma unroll
    for (int q = t; q < kScaleCols * kMxTileCols; q += kThreads) {
      const int m = q / kMxTileCols, i = q % kMxTileCols;
      const int64_t mb = (r0 >> 5) + m;
      uint32_t code = 0u;
      if (mb < (R >> 5) && c0 + i < C) {
        code = __ldg(a.scale + layout::SwizzledIndex(p * C + c0 + i, mb, a.scale_cols_padded));
      }
      scales[m][i] = uint8_t(code);
    }
  }
  const int lr = t / kRunsPerRow, cg = t % kRunsPerRow;
  const int64_t c = c0 + cg * kSeg;
  uint4 w[kScaleCols];
#pragma unroll
  for (int m = 0; m < kScaleCols; ++m) {
    const int64_t r = r0 + m * kRowsPerPass + lr;
    w[m] = make_uint4(0u, 0u, 0u, 0u);
    if (r < R && c < C) w[m] = __ldg(reinterpret_cast<const uint4*>(a.data + (p * R + r) * C + c));
  }
  __syncthreads();
#pragma unroll
  for (int m = 0; m < kScaleCols; ++m) {
    const int64_t r = r0 + m * kRowsPerPass + lr;
    if (r >= R || c >= C) continue;  // C % 16 == 0: runs are whole
    const uint4 s = *reinterpret_cast<const uint4*>(&scales[m][cg * kSeg]);
    const uint32_t words[4] = {w[m].x, w[m].y, w[m].z, w[m].w}, sw[4] = {s.x, s.y, s.z, s.w};
    float v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int sh = 8 * (i & 3);
      v[i] = MxDecode<kKind>((words[i >> 2] >> sh) & 0xFFu, E8M0Value((sw[i >> 2] >> sh) & 0xFFu),
                             OutMaxBits<Out>());
    }
    uint4* dst = reinterpret_cast<uint4*>(static_cast<Out*>(a.out) + (p * R + r) * C + c);
    constexpr int kV = 16 / int(sizeof(Out));
#pragma unroll
    for (int q = 0; q < 16 / kV; ++q) {
      float part[kV];
#pragma unroll
      for (int i = 0; i < kV; ++i) part[i] = v[q * kV + i];
      dst[q] = PackRun<Out, kV>(part);
    }
  }
}

// Launch for P * R * C > 0 (the caller checked the alignment conditions above).
template <typename Out, int kKind>
cudaError_t LaunchMxColumnwiseSwizzled(const Args& a, cudaStream_t stream) {
  const int64_t row_tiles = (a.R + kMxTileRows - 1) / kMxTileRows, col_tiles = (a.C + kMxTileCols - 1) / kMxTileCols;
  const int64_t blocks = a.P * row_tiles * col_tiles;
  if (blocks >= (int64_t(1) << 31)) return cudaErrorInvalidValue;
  MxColumnwiseSwizzledKernel<Out, kKind><<<unsigned(blocks), kThreads, 0, stream>>>(a, row_tiles, col_tiles);
  return cudaGetLastError();
}

}  // namespace dequantize
}  // namespace jax_fp4
