// Block-scaled -> float dequantization (NUMERICS.md sections 1-3), bit-exact to jax_fp4.reference.
//
// The stored data is viewed as [P, R, C] (NVFP4: the rowwise layout, block axis C last; MXFP8: x's layout with the
// blocks along C (rowwise) or R (columnwise)). One 256-thread block owns a 64x64 tile; thread t decodes the 16
// consecutive elements (row t/4, columns 16*(t%4)...) and writes them either in place or, for NVFP4 tensors whose
// block axis is not x's last axis, transposed through shared memory so the output rows stay coalesced.
// Every output element is written once; no atomics, no scratch (CUDA-graph safe).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/convert.cuh"
#include "quantize/quantize.cuh"

namespace jax_fp4 {
namespace dequantize {

enum Kind : int { kNvfp4 = 1, kMxfp8E4m3 = 2, kMxfp8E5m2 = 3 };
enum Option : int { kRht = 2, k1x64 = 8, kSwizzled = 1 << 16, kTransposeOut = 1 << 17, kMxColumnwise = 1 << 18 };

constexpr int kTile = 64;
constexpr int kThreads = 256;

struct Args {
  const uint8_t* data;
  const uint8_t* scale;
  const float* amax;         // NVFP4 1D/2D/RHT: [1]
  const float* window_amax;  // NVFP4 1x64: [P*R, C/64]
  void* out;
  int64_t P, R, C;
  int flags;
  int64_t scale_cols_padded;
};

// E2M1 code -> value, built on the fp32 bits (no table: a dynamically indexed array would live in local memory).
// Exponent field e = code bits 1..2, mantissa m = bit 0: e == 0 gives 0 or 0.5; else (1 + m/2) * 2^(e-1). Code 8 = -0.
__device__ __forceinline__ float E2M1Value(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const uint32_t mag = e ? (((e + 126u) << 23) | (m << 22)) : (m ? 0x3F000000u : 0u);
  return __uint_as_float(mag | ((code & 8u) << 28));
}

// Exact float of an E4M3 / E5M2 code (NaN codes give NaN).
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

// fp32 -> output element, RNE, canonical NaN (0x7FC00000 / 0x7FC0 / 0x7E00) as the reference writes it.
template <typename Out>
__device__ __forceinline__ Out ToOut(float v);
template <>
__device__ __forceinline__ float ToOut<float>(float v) { return v != v ? __uint_as_float(0x7FC00000u) : v; }
template <>
__device__ __forceinline__ __nv_bfloat16 ToOut<__nv_bfloat16>(float v) {
  return v != v ? __ushort_as_bfloat16(0x7FC0u) : __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half ToOut<__half>(float v) {
  return v != v ? __ushort_as_half(0x7E00u) : __float2half_rn(v);
}

template <typename Out>
__device__ __forceinline__ void Store16(Out* dst, const float (&v)[16], int valid) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    if (i < valid) dst[i] = ToOut<Out>(v[i]);
  }
}

__device__ __forceinline__ int64_t ScaleIndex(const Args& a, int64_t row, int64_t col, int64_t cols) {
  return (a.flags & kSwizzled) ? quantize::SwizzledIndex(row, col, a.scale_cols_padded) : row * cols + col;
}

// Decodes the 16 elements of stored row `r` (of x[p]) starting at column c into v.
template <int kKind>
__device__ __forceinline__ void Decode16(const Args& a, int64_t p, int64_t r, int64_t c, float (&v)[16]) {
  const int64_t R = a.R, C = a.C;
  const int64_t flat = (p * R + r) * C + c;
  if constexpr (kKind == kNvfp4) {
    const uint2 w = *reinterpret_cast<const uint2*>(a.data + flat / 2);
    const int64_t srow = p * R + r;
    const float s_b = cvt::E4M3Value(a.scale[ScaleIndex(a, srow, c >> 4, C >> 4)]);
    float f = 0.0f, enc = 1.0f;
    const bool local = a.flags & k1x64;
    if (local) {
      enc = cvt::WindowEncodeScale(a.window_amax[srow * (C >> 6) + (c >> 6)]);
    } else {
      f = __fmul_rn(__fmul_rn(s_b, a.amax[0]), cvt::kInv2688());  // (s_b * amax) * fp32(1/2688)
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint32_t word = i < 8 ? w.x : w.y;
      const float q = E2M1Value((word >> (4 * (i & 7))) & 0xFu);
      v[i] = local ? __fdiv_rn(__fmul_rn(q, s_b), enc) : __fmul_rn(q, f);
    }
    if (a.flags & kRht) RhtInverse16(v);
  } else {
    const uint4 w = *reinterpret_cast<const uint4*>(a.data + flat);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
    if (a.flags & kMxColumnwise) {  // blocks along R: element (r, c+i) uses scale [r/32, c+i]
      const int64_t mb = r >> 5;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int64_t idx = (a.flags & kSwizzled) ? quantize::SwizzledIndex(p * C + c + i, mb, a.scale_cols_padded)
                                                  : (p * (R >> 5) + mb) * C + c + i;
        const float s = E8M0Value(a.scale[idx]);
        v[i] = __fmul_rn(Fp8Value<kKind>((words[i >> 2] >> (8 * (i & 3))) & 0xFFu), s);
      }
    } else {
      const float s = E8M0Value(a.scale[ScaleIndex(a, p * R + r, c >> 5, C >> 5)]);
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = __fmul_rn(Fp8Value<kKind>((words[i >> 2] >> (8 * (i & 3))) & 0xFFu), s);
    }
  }
}

template <typename Out, int kKind>
__global__ void __launch_bounds__(kThreads) DequantizeKernel(const Args a) {
  __shared__ float tile[kKind == kNvfp4 ? kTile : 1][kTile + 1];
  const int t = threadIdx.x;
  const int64_t p = blockIdx.z, r0 = int64_t(blockIdx.y) * kTile, c0 = int64_t(blockIdx.x) * kTile;
  const int lr = t >> 2, cg = t & 3;
  const int64_t r = r0 + lr, c = c0 + cg * 16;
  const bool in = r < a.R && c < a.C;  // C % 16 == 0: segments are whole
  float v[16];
  if (in) Decode16<kKind>(a, p, r, c, v);
  Out* out = static_cast<Out*>(a.out);
  if (kKind != kNvfp4 || !(a.flags & kTransposeOut)) {
    if (in) Store16<Out>(out + (p * a.R + r) * a.C + c, v, 16);
    return;
  }
  if constexpr (kKind == kNvfp4) {
    // Output x[p] is the transpose [C, R] of the stored [R, C]: stage the tile, write rows of the transpose.
#pragma unroll
    for (int i = 0; i < 16; ++i) tile[cg * 16 + i][lr] = in ? v[i] : 0.0f;
    __syncthreads();
    const int64_t orow = c0 + lr, ocol = r0 + cg * 16;  // output row (a stored column), 16 output columns
    if (orow >= a.C || ocol >= a.R) return;
    float w[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i] = tile[lr][cg * 16 + i];
    const int64_t left = a.R - ocol;
    Store16<Out>(out + (p * a.C + orow) * a.R + ocol, w, left < 16 ? int(left) : 16);
  }
}

template <typename Out, int kKind>
cudaError_t Launch(const Args& a, cudaStream_t stream) {
  const dim3 grid(unsigned((a.C + kTile - 1) / kTile), unsigned((a.R + kTile - 1) / kTile), unsigned(a.P));
  DequantizeKernel<Out, kKind><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace dequantize
}  // namespace jax_fp4
