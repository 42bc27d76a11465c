// Block-scaled -> float dequantization (NUMERICS.md sections 1-3), bit-exact to jax_fp4.reference.
//
// The stored data is viewed as [P, R, C] (NVFP4: the rowwise layout, block axis C last; MXFP8: x's layout with the
// blocks along C (rowwise) or along R (columnwise)); its rows are the P * R flattened rows. The unit of work is a
// segment: 16 consecutive elements of one row (one NVFP4 block / RHT chunk, half an MXFP8 block).
//  * RowsKernel (every case whose output keeps the stored layout): thread g decodes segment g of the flat
//    [P * R, ceil(C / 16)] segment grid, so a warp reads and writes contiguous memory (16-byte vector accesses where
//    rows are 16-byte aligned). Only MXFP8 columnwise data may have C % 16 != 0: its last segment per row is partial.
//  * TransposeKernel (NVFP4 whose block axis is not x's last axis: the output x[p] is the stored [R, C] transposed):
//    a 256-thread block owns a 64x64 tile, decodes it like RowsKernel and writes the transpose through shared memory
//    so the output rows stay coalesced.
// Scales are read compact or straight from the GEMM-swizzled layout. The tensor amax is one float or one per p (vmap
// folds its batch into P). Every output element is written once; no atomics, no scratch (CUDA-graph safe).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/convert.cuh"
#include "common/scale_layout.cuh"

namespace jax_fp4 {
namespace dequantize {

enum Kind : int { kNvfp4 = 1, kMxfp8E4m3 = 2, kMxfp8E5m2 = 3 };
enum Option : int { kRht = 2, k1x64 = 8, kSwizzled = 1 << 16, kTransposeOut = 1 << 17, kMxColumnwise = 1 << 18 };

constexpr int kSeg = 16;
constexpr int kTile = 64;
constexpr int kThreads = 256;

struct Args {
  const uint8_t* data;       // [P, R, C] codes (float4: packed, even index in the low nibble)
  const uint8_t* scale;      // compact or swizzled block scales
  const float* amax;         // NVFP4 1D/2D/RHT: [1] or [P]
  const float* window_amax;  // NVFP4 1x64: [P, R, C/64]
  void* out;
  int64_t P, R, C;
  int64_t segs_per_row;       // ceil(C / 16)
  int64_t scale_cols_padded;  // columns of the swizzled scale matrix
  int flags;
  bool amax_per_p;   // amax holds P values
  bool vector_data;  // C % 16 == 0 and aligned pointers: data (and compact MX columnwise scales) as vectors
  bool vector_out;   // 16-element output runs start 16-byte aligned
  bool small;        // every flat segment index fits in 32 bits
};

// E2M1 code -> value, built on the fp32 bits (no table: a dynamically indexed array would live in local memory).
// Exponent field e = code bits 1..2, mantissa m = bit 0: e == 0 gives 0 or 0.5; else (1 + m/2) * 2^(e-1). Code 8 = -0.
__device__ __forceinline__ float E2M1Value(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const uint32_t mag = e ? (((e + 126u) << 23) | (m << 22)) : (m ? 0x3F000000u : 0u);
  return __uint_as_float(mag | ((code & 8u) << 28));
}

// Exact float of an E4M3 / E5M2 code (NaN codes give NaN, E5M2 infinities give infinities).
template <int kKind>
__device__ __forceinline__ float Fp8Value(uint32_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code),
                                               kKind == kMxfp8E4m3 ? __NV_E4M3 : __NV_E5M2);
  return __half2float(__half(h));
}

// E8M0 code -> 2^(e-127): code 0 is the fp32 subnormal 2^-127, 255 is NaN.
__device__ __forceinline__ float E8M0Value(uint32_t e) {
  if (e == 255u) return __uint_as_float(0x7FC00000u);
  if (e == 0u) return __uint_as_float(0x00400000u);
  return __uint_as_float(e << 23);
}

// Inverse RHT of one 16-chunk in fp32: flush, butterfly (flushed), * 0.25 (flushed), then the signs.
__device__ __forceinline__ void RhtInverse16(float (&v)[16]) {
  constexpr uint32_t kSignMask = 0xD7E8u;
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = cvt::FlushSubnormal(v[i]);
  cvt::ButterflyStage<1>(v);
  cvt::ButterflyStage<2>(v);
  cvt::ButterflyStage<4>(v);
  cvt::ButterflyStage<8>(v);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float f = cvt::FlushSubnormal(__fmul_rn(v[i], 0.25f));
    v[i] = ((kSignMask >> i) & 1u) ? __uint_as_float(__float_as_uint(f) ^ 0x80000000u) : f;
  }
}

// fp32 -> output bits, RNE, canonical NaN (0x7FC00000 / 0x7FC0 / 0x7E00) as the reference writes it.
template <typename Out>
__device__ __forceinline__ uint32_t OutBits(float v);
template <>
__device__ __forceinline__ uint32_t OutBits<float>(float v) { return v != v ? 0x7FC00000u : __float_as_uint(v); }
template <>
__device__ __forceinline__ uint32_t OutBits<__nv_bfloat16>(float v) {
  return v != v ? 0x7FC0u : uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(v)));
}
template <>
__device__ __forceinline__ uint32_t OutBits<__half>(float v) {
  return v != v ? 0x7E00u : uint32_t(__half_as_ushort(__float2half_rn(v)));
}

// Writes v[0..valid) to dst: 16-byte stores when `vector` (dst 16-byte aligned) and the run is whole.
template <typename Out>
__device__ __forceinline__ void Store16(Out* dst, const float (&v)[16], int valid, bool vector) {
  if (vector && valid == 16) {
    if constexpr (sizeof(Out) == 4) {
      uint4* d = reinterpret_cast<uint4*>(dst);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        d[q] = make_uint4(OutBits<Out>(v[4 * q]), OutBits<Out>(v[4 * q + 1]), OutBits<Out>(v[4 * q + 2]),
                          OutBits<Out>(v[4 * q + 3]));
      }
    } else {
      uint32_t w[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) w[i] = OutBits<Out>(v[2 * i]) | (OutBits<Out>(v[2 * i + 1]) << 16);
      uint4* d = reinterpret_cast<uint4*>(dst);
      d[0] = make_uint4(w[0], w[1], w[2], w[3]);
      d[1] = make_uint4(w[4], w[5], w[6], w[7]);
    }
    return;
  }
  using Bits = typename std::conditional<sizeof(Out) == 4, uint32_t, uint16_t>::type;
  Bits* d = reinterpret_cast<Bits*>(dst);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    if (i < valid) d[i] = Bits(OutBits<Out>(v[i]));
  }
}

__device__ __forceinline__ int64_t ScaleIndex(const Args& a, int64_t row, int64_t col, int64_t cols) {
  return (a.flags & kSwizzled) ? layout::SwizzledIndex(row, col, a.scale_cols_padded) : row * cols + col;
}

// Decodes the segment of flat row `row` (= p * R + r) starting at column c (valid elements: min(16, C - c)).
template <int kKind>
__device__ __forceinline__ void DecodeSegment(const Args& a, int64_t row, int64_t c, int valid, float (&v)[16]) {
  const int64_t C = a.C;
  if constexpr (kKind == kNvfp4) {  // C % 16 == 0: whole segments of 8 bytes
    const uint8_t* src = a.data + (row * C + c) / 2;
    uint2 w = make_uint2(0u, 0u);
    if (a.vector_data) {
      w = __ldg(reinterpret_cast<const uint2*>(src));
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) (i < 4 ? w.x : w.y) |= uint32_t(__ldg(src + i)) << (8 * (i & 3));
    }
    const float s_b = cvt::E4M3Value(__ldg(a.scale + ScaleIndex(a, row, c >> 4, C >> 4)));
    const bool local = a.flags & k1x64;
    float f = 0.0f, enc = 1.0f;
    if (local) {
      enc = cvt::WindowEncodeScale(__ldg(a.window_amax + row * (C >> 6) + (c >> 6)));
    } else {
      const float amax = __ldg(a.amax + (a.amax_per_p ? row / a.R : 0));
      f = __fmul_rn(__fmul_rn(s_b, amax), cvt::kInv2688());  // (s_b * amax) * fp32(1/2688)
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint32_t word = i < 8 ? w.x : w.y;
      const float q = E2M1Value((word >> (4 * (i & 7))) & 0xFu);
      v[i] = local ? __fdiv_rn(__fmul_rn(q, s_b), enc) : __fmul_rn(q, f);
    }
    if (a.flags & kRht) RhtInverse16(v);
  } else {
    uint32_t words[4] = {0u, 0u, 0u, 0u};
    const uint8_t* src = a.data + row * C + c;
    if (a.vector_data) {
      const uint4 w = __ldg(reinterpret_cast<const uint4*>(src));
      words[0] = w.x, words[1] = w.y, words[2] = w.z, words[3] = w.w;
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        if (i < valid) words[i >> 2] |= uint32_t(__ldg(src + i)) << (8 * (i & 3));
      }
    }
    if (a.flags & kMxColumnwise) {  // blocks along R: element (r, c + i) uses scale [p, r / 32, c + i]
      const int64_t p = row / a.R, mb = (row - p * a.R) >> 5;
      uint32_t sc[4] = {0u, 0u, 0u, 0u};
      if (a.flags & kSwizzled) {  // scale matrix [P * C, R / 32]: row p * C + c + i, column mb
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          if (i < valid) {
            const int64_t idx = layout::SwizzledIndex(p * C + c + i, mb, a.scale_cols_padded);
            sc[i >> 2] |= uint32_t(__ldg(a.scale + idx)) << (8 * (i & 3));
          }
        }
      } else {
        const uint8_t* s = a.scale + (p * (a.R >> 5) + mb) * C + c;
        if (a.vector_data) {
          const uint4 w = __ldg(reinterpret_cast<const uint4*>(s));
          sc[0] = w.x, sc[1] = w.y, sc[2] = w.z, sc[3] = w.w;
        } else {
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            if (i < valid) sc[i >> 2] |= uint32_t(__ldg(s + i)) << (8 * (i & 3));
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const uint32_t q = (words[i >> 2] >> (8 * (i & 3))) & 0xFFu, e = (sc[i >> 2] >> (8 * (i & 3))) & 0xFFu;
        v[i] = __fmul_rn(Fp8Value<kKind>(q), E8M0Value(e));
      }
    } else {  // rowwise: C % 32 == 0, one scale per segment
      const float s = E8M0Value(__ldg(a.scale + ScaleIndex(a, row, c >> 5, C >> 5)));
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = __fmul_rn(Fp8Value<kKind>((words[i >> 2] >> (8 * (i & 3))) & 0xFFu), s);
    }
  }
}

template <typename Out, int kKind>
__global__ void __launch_bounds__(kThreads) RowsKernel(const Args a, int64_t num_segments) {
  int64_t row, c;
  if (a.small) {
    const uint32_t g = blockIdx.x * uint32_t(kThreads) + threadIdx.x;
    if (g >= uint64_t(num_segments)) return;
    const uint32_t spr = uint32_t(a.segs_per_row), rr = g / spr;
    row = rr;
    c = int64_t(g - rr * spr) * kSeg;
  } else {
    const int64_t g = int64_t(blockIdx.x) * kThreads + threadIdx.x;
    if (g >= num_segments) return;
    row = g / a.segs_per_row;
    c = (g - row * a.segs_per_row) * kSeg;
  }
  const int64_t left = a.C - c;
  const int valid = left < kSeg ? int(left) : kSeg;
  float v[16];
  DecodeSegment<kKind>(a, row, c, valid, v);
  Store16<Out>(static_cast<Out*>(a.out) + row * a.C + c, v, valid, a.vector_out);
}

// NVFP4 with kTransposeOut: out[p] = stored[p].T, [C, R]. Grid: P * ceil(R / 64) * ceil(C / 64) blocks.
template <typename Out>
__global__ void __launch_bounds__(kThreads) TransposeKernel(const Args a) {
  __shared__ float tile[kTile][kTile + 1];
  const int t = threadIdx.x;
  const int64_t col_tiles = (a.C + kTile - 1) / kTile, row_tiles = (a.R + kTile - 1) / kTile;
  int64_t blk = blockIdx.x;
  const int64_t ct = blk % col_tiles;
  blk /= col_tiles;
  const int64_t rt = blk % row_tiles, p = blk / row_tiles;
  const int64_t r0 = rt * kTile, c0 = ct * kTile;
  const int lr = t >> 2, cg = t & 3;  // stored row r0 + lr, columns c0 + 16 * cg ...
  const int64_t r = r0 + lr, c = c0 + cg * kSeg;
  float v[16];
  if (r < a.R && c < a.C) {  // C % 16 == 0: segments are whole
    DecodeSegment<kNvfp4>(a, p * a.R + r, c, kSeg, v);
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = 0.0f;
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) tile[cg * kSeg + i][lr] = v[i];
  __syncthreads();
  const int64_t orow = c0 + lr, ocol = r0 + cg * kSeg;  // output row (a stored column), 16 output columns
  if (orow >= a.C || ocol >= a.R) return;
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = tile[lr][cg * kSeg + i];
  const int64_t left = a.R - ocol;
  Store16<Out>(static_cast<Out*>(a.out) + (p * a.C + orow) * a.R + ocol, v, left < kSeg ? int(left) : kSeg,
               a.vector_out);
}

// Host side: fills the derived fields of `a` (P, R, C, flags, pointers set by the caller) and launches. Returns
// cudaSuccess without a launch for an empty tensor; cudaErrorInvalidValue when the grid would exceed 2^31 - 1 blocks.
template <typename Out, int kKind>
cudaError_t Launch(Args a, cudaStream_t stream) {
  const int64_t n = a.P * a.R * a.C;
  if (n == 0) return cudaSuccess;
  a.segs_per_row = (a.C + kSeg - 1) / kSeg;
  const bool mx_col_compact = kKind != kNvfp4 && (a.flags & kMxColumnwise) && !(a.flags & kSwizzled);
  const uintptr_t data_align = kKind == kNvfp4 ? 8 : 16;
  a.vector_data = a.C % kSeg == 0 && reinterpret_cast<uintptr_t>(a.data) % data_align == 0 &&
                  (!mx_col_compact || reinterpret_cast<uintptr_t>(a.scale) % 16 == 0);
  if (kKind == kNvfp4 && (a.flags & kTransposeOut)) {
    a.vector_out = (a.R * int64_t(sizeof(Out))) % 16 == 0 && reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
    const int64_t blocks = a.P * ((a.R + kTile - 1) / kTile) * ((a.C + kTile - 1) / kTile);
    if (blocks >= (int64_t(1) << 31)) return cudaErrorInvalidValue;
    TransposeKernel<Out><<<unsigned(blocks), kThreads, 0, stream>>>(a);
  } else {
    a.vector_out = (a.C * int64_t(sizeof(Out))) % 16 == 0 && reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
    const int64_t segments = a.P * a.R * a.segs_per_row;
    const int64_t blocks = (segments + kThreads - 1) / kThreads;
    if (blocks >= (int64_t(1) << 31)) return cudaErrorInvalidValue;
    a.small = blocks * kThreads < (int64_t(1) << 32);
    RowsKernel<Out, kKind><<<unsigned(blocks), kThreads, 0, stream>>>(a, segments);
  }
  return cudaGetLastError();
}

}  // namespace dequantize
}  // namespace jax_fp4
