// The GEMM-swizzled block-scale layout's index formula (docs/numerics.md section 3), shared by the kernels that read or
// write swizzled scales (cpp/dequantize/, cpp/swizzle/).
#pragma once

#include <cstdint>

#include "common/hd.h"

namespace jax_fp4 {
namespace layout {

constexpr int kTileRows = 128;  // a swizzle tile: 128 rows x 4 columns of scales, 512 contiguous bytes
constexpr int kTileCols = 4;
constexpr int kTileBytes = kTileRows * kTileCols;

// Flat byte index of S[i, j] in a swizzled padded scale matrix with `cols_padded` (% 4 == 0) columns:
// tile (i / 128, j / 4) in row-major tile order, then (i % 32) * 16 + ((i % 128) / 32) * 4 + j % 4 inside it.
JF4_HD int64_t SwizzledIndex(int64_t i, int64_t j, int64_t cols_padded) {
  return ((i >> 7) * (cols_padded >> 2) + (j >> 2)) * kTileBytes + (i & 31) * 16 + ((i & 127) >> 5) * 4 + (j & 3);
}

}  // namespace layout
}  // namespace jax_fp4
