// Block-scaled -> float dequantization (docs/numerics.md sections 1-3), bit-exact to jax_fp4.reference.
//
// The stored data is viewed as [P, R, C] (NVFP4: the rowwise layout, block axis C last; MXFP8: x's layout with the
// blocks along C (rowwise) or along R (columnwise)); its rows are the P * R flattened rows. The unit of work is a
// segment: 16 consecutive elements of one row (one NVFP4 block / RHT chunk, half an MXFP8 block).
//  * RowsKernel (every case whose output keeps the stored layout): thread g decodes segment g of the flat
//    [P * R, ceil(C / 16)] segment grid, so a warp reads and writes contiguous memory (16-byte vector accesses where
//    rows are 16-byte aligned). Only MXFP8 columnwise data may have C % 16 != 0: its last segment per row is partial.
//  * FlatKernel (below): the aligned cases whose runs never cross a block, as one flat array of 16-byte runs.
//  * TransposeKernel (transpose.cuh; NVFP4 whose block axis is not x's last axis: the output x[p] is the stored
//    [R, C] transposed): 128x64 tiles written out through shared memory so the output rows stay coalesced.
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
#include "dequantize/args.cuh"
#include "dequantize/decode.cuh"
#include "dequantize/half_table.cuh"
#include "dequantize/mx_columnwise.cuh"
#include "dequantize/transpose.cuh"

namespace jax_fp4 {
namespace dequantize {

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

// Decodes the segment of flat row `row` (= p * R + r) starting at column c (valid elements: min(16, C - c)).
// max_bits: OutMaxBits of the output type (MXFP8 saturation, MxDecode).
template <int kKind>
__device__ __forceinline__ void DecodeSegment(const Args& a, int64_t row, int64_t c, int valid, float (&v)[16],
                                              uint32_t max_bits) {
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
    } else if (a.flags & kBlockOnly) {
      f = s_b;
    } else {
      const float amax = __ldg(a.amax + (a.amax_per_p ? row / a.R : 0));
      f = cvt::Nvfp4DecodeScale(s_b, amax, a.flags & kBound256);  // (s_b * amax) * fp32(1/2688), range-safe
    }
    float q[2][8];
    E2M1xN<8>(w.x, q[0]);
    E2M1xN<8>(w.y, q[1]);
    if (local) {  // uniform across the launch: one loop or the other
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = __fdiv_rn(__fmul_rn(q[i >> 3][i & 7], s_b), enc);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = __fmul_rn(q[i >> 3][i & 7], f);
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
      if ((a.flags & kSwizzled) && a.vector_data) {
        // C % 16 == 0: rows p * C + c .. + 15 lie in one 32-row group of one tile, 16 bytes apart
        const uint8_t* s = a.scale + layout::SwizzledIndex(p * C + c, mb, a.scale_cols_padded);
#pragma unroll
        for (int i = 0; i < 16; ++i) sc[i >> 2] |= uint32_t(__ldg(s + 16 * i)) << (8 * (i & 3));
      } else if (a.flags & kSwizzled) {  // scale matrix [P * C, R / 32]: row p * C + c + i, column mb
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
        v[i] = MxDecode<kKind>(q, E8M0Value(e), max_bits);
      }
    } else {  // rowwise: C % 32 == 0, one scale per segment
      const float s = E8M0Value(__ldg(a.scale + ScaleIndex(a, row, c >> 5, C >> 5)));
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = MxDecode<kKind>((words[i >> 2] >> (8 * (i & 3))) & 0xFFu, s, max_bits);
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
  DecodeSegment<kKind>(a, row, c, valid, v, OutMaxBits<Out>());
  Store16<Out>(static_cast<Out*>(a.out) + row * a.C + c, v, valid, a.vector_out);
}

// Loads `kBytes` (2, 4 or 8) bytes as the low bytes of a uint2.
template <int kBytes>
__device__ __forceinline__ uint2 LoadRun(const uint8_t* p) {
  if constexpr (kBytes == 8) return __ldg(reinterpret_cast<const uint2*>(p));
  if constexpr (kBytes == 4) return make_uint2(__ldg(reinterpret_cast<const uint32_t*>(p)), 0u);
  return make_uint2(__ldg(reinterpret_cast<const uint16_t*>(p)), 0u);
}

// FlatKernel: NVFP4 without RHT whose output keeps the stored layout (1D, 2D, 1x64), MXFP8 rowwise and MXFP8
// columnwise with compact scales, with 16-byte aligned data and output. As C % 16 == 0 (NVFP4, MXFP8 columnwise
// here) / C % 32 == 0 (MXFP8 rowwise), a run of kV = 16 / sizeof(Out) elements never crosses a block or a row, so
// the tensor is a flat array of runs: the compact scale of element e is e / 16 (e / 32), its 1x64 window e / 64,
// and an MXFP8 columnwise run (row, c .. c + kV) takes kV consecutive scale bytes at (row / 32) * C + c. Thread t
// of block b decodes runs (b * kUnroll + j) * kThreads + t, j < kUnroll: each warp-wide load and 16-byte store
// covers one contiguous span, and every thread issues all its loads before its first store. 16-bit 1x64 runs (8 codes
// of one block) in a safe window decode through the block's table (half_table.cuh: two divisions a run instead of
// one per element), and swizzled scales find the row with a multiplication instead of a division (RowOf): together
// they gained 4-6 points of copy (docs/kernels/dequantize.md).
constexpr int kUnroll = 4;

// Flat row e / C: 32-bit indices (e < 2^31) use the host's multiplier (Args::c_magic / c_shift, SetRowDivisor).
template <typename Idx>
__device__ __forceinline__ Idx RowOf(const Args& a, Idx e) {
  if constexpr (sizeof(Idx) == 4) return __umulhi(e, a.c_magic) >> a.c_shift;
  return e / Idx(a.C);
}

enum FlatVariant : int { kFlatBlock = 0, kFlatLocal = 1, kFlatMxColumnwise = 2 };

template <typename Out, int kKind, typename Idx, int kVar>
__global__ void __launch_bounds__(kThreads) FlatKernel(const Args a, Idx num_runs) {
  constexpr int kV = 16 / int(sizeof(Out));
  constexpr int kBytes = kKind == kNvfp4 ? kV / 2 : kV;
  constexpr int kShift = kKind == kNvfp4 ? 4 : 5;  // log2 of the block size
  constexpr bool kLocal = kVar == kFlatLocal, kMxCol = kVar == kFlatMxColumnwise;
  const Idx C = Idx(a.C);
  uint2 raw[kUnroll], sraw[kUnroll];
  float mult[kUnroll], div[kUnroll];
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    const Idx run = (Idx(blockIdx.x) * kUnroll + j) * kThreads + threadIdx.x;
    if (run >= num_runs) break;
    const Idx e = run * kV;
    raw[j] = LoadRun<kBytes>(a.data + (kKind == kNvfp4 ? e / 2 : e));
    if constexpr (kMxCol) {
      const Idx row = RowOf(a, e);
      sraw[j] = LoadRun<kV>(a.scale + (row >> 5) * C + (e - row * C));
      continue;
    }
    Idx si = e >> kShift;
    if (a.flags & kSwizzled) {
      const Idx row = RowOf(a, e);
      si = Idx(layout::SwizzledIndex(row, (e - row * C) >> kShift, a.scale_cols_padded));
    }
    const uint32_t code = __ldg(a.scale + si);
    if constexpr (kKind != kNvfp4) {
      mult[j] = E8M0Value(code);
    } else if constexpr (kLocal) {
      mult[j] = cvt::E4M3Value(code);
      div[j] = cvt::WindowEncodeScale(__ldg(a.window_amax + (e >> 6)));
    } else if (a.flags & kBlockOnly) {
      mult[j] = cvt::E4M3Value(code);
    } else {
      const float amax = __ldg(a.amax + (a.amax_per_p ? e / (Idx(a.R) * C) : Idx(0)));
      mult[j] = cvt::Nvfp4DecodeScale(cvt::E4M3Value(code), amax, a.flags & kBound256);
    }
  }
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    const Idx run = (Idx(blockIdx.x) * kUnroll + j) * kThreads + threadIdx.x;
    if (run >= num_runs) break;
    float v[kV];
    if constexpr (kKind == kNvfp4 && kLocal && sizeof(Out) == 2) {  // 16-bit 1x64 runs: one block's table
      if (isfinite(mult[j]) && WindowDivisor::Safe(div[j])) {
        reinterpret_cast<uint4*>(a.out)[run] = TableRun8(MakeLocalHalfTable<Out>(mult[j], WindowDivisor::Of(div[j])),
                                                         raw[j].x);
        continue;
      }
    }
    if constexpr (kKind == kNvfp4) {
      E2M1xN<kV>(raw[j].x, v);
#pragma unroll
      for (int i = 0; i < kV; ++i) v[i] = __fmul_rn(v[i], mult[j]);
      if constexpr (kLocal) {  // / S_enc of the window: Markstein's sequence where it is exact, else a division
        if (isfinite(mult[j]) && WindowDivisor::Safe(div[j])) {
          const WindowDivisor d = WindowDivisor::Of(div[j]);
#pragma unroll
          for (int i = 0; i < kV; ++i) v[i] = d.Div(v[i]);
        } else {
#pragma unroll
          for (int i = 0; i < kV; ++i) v[i] = __fdiv_rn(v[i], div[j]);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        const uint32_t word = i < 4 ? raw[j].x : raw[j].y;
        float s;
        if constexpr (kMxCol) {
          s = E8M0Value(((i < 4 ? sraw[j].x : sraw[j].y) >> (8 * (i & 3))) & 0xFFu);
        } else {
          s = mult[j];
        }
        v[i] = MxDecode<kKind>((word >> (8 * (i & 3))) & 0xFFu, s, OutMaxBits<Out>());
      }
    }
    // A finite multiplier with finite codes (NVFP4 has no NaN codes; 1x64: a finite s_b over an S_enc in the range
    // WindowDivisor accepts — an infinite window amax gives S_enc = 0) gives no NaN: pack without the NaN fix-up.
    const bool fast = kKind == kNvfp4 && isfinite(mult[j]) && (!kLocal || WindowDivisor::Safe(div[j]));
    reinterpret_cast<uint4*>(a.out)[run] = fast ? PackRunFinite<Out, kV>(v) : PackRun<Out, kV>(v);
  }
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
    return LaunchTranspose<Out>(a, stream);
  }
  a.vector_out = (a.C * int64_t(sizeof(Out))) % 16 == 0 && reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
  const bool mx_col = kKind != kNvfp4 && (a.flags & kMxColumnwise);
  if (mx_col && (a.flags & kSwizzled) && a.vector_data && a.vector_out &&
      reinterpret_cast<uintptr_t>(a.data) % 16 == 0) {
    return LaunchMxColumnwiseSwizzled<Out, kKind>(a, stream);
  }
  const bool flat = (kKind == kNvfp4 ? !(a.flags & kRht) : (!mx_col || !(a.flags & kSwizzled))) && a.vector_data &&
                    a.vector_out && reinterpret_cast<uintptr_t>(a.data) % 16 == 0;
  if (flat) {
    const int64_t runs = n / (16 / int64_t(sizeof(Out)));
    const int64_t blocks = (runs + kThreads * kUnroll - 1) / (kThreads * kUnroll);
    if (blocks >= (int64_t(1) << 31)) return cudaErrorInvalidValue;
    const bool small = n < (int64_t(1) << 31) && SetRowDivisor(a);
    // (Only the variants a kind can take are instantiated: 1x64 is NVFP4's, columnwise scales MXFP8's.)
    constexpr int kOther = kKind == kNvfp4 ? kFlatLocal : kFlatMxColumnwise;
    if ((kKind == kNvfp4 && (a.flags & k1x64)) || mx_col) {
      if (small) FlatKernel<Out, kKind, uint32_t, kOther><<<unsigned(blocks), kThreads, 0, stream>>>(a, uint32_t(runs));
      else FlatKernel<Out, kKind, int64_t, kOther><<<unsigned(blocks), kThreads, 0, stream>>>(a, runs);
    } else {
      if (small) FlatKernel<Out, kKind, uint32_t, kFlatBlock><<<unsigned(blocks), kThreads, 0, stream>>>(a, uint32_t(runs));
      else FlatKernel<Out, kKind, int64_t, kFlatBlock><<<unsigned(blocks), kThreads, 0, stream>>>(a, runs);
    }
    return cudaGetLastError();
  }
  const int64_t segments = a.P * a.R * a.segs_per_row;
  const int64_t blocks = (segments + kThreads - 1) / kThreads;
  if (blocks >= (int64_t(1) << 31)) return cudaErrorInvalidValue;
  a.small = blocks * kThreads < (int64_t(1) << 32);
  RowsKernel<Out, kKind><<<unsigned(blocks), kThreads, 0, stream>>>(a, segments);
  return cudaGetLastError();
}

}  // namespace dequantize
}  // namespace jax_fp4
