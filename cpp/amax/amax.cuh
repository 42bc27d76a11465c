// Tensor amax: fmax-reduction of |x| over a whole tensor (docs/numerics.md section 1, "Tensor scale").
//
// Bit-exact by construction: the reduction runs on integer bit patterns. |x| is the pattern with the sign bit
// cleared; a NaN pattern is replaced by +0 (fmaxf ignores NaN), and non-negative IEEE values order like their
// patterns as unsigned integers (subnormals included, so nothing is flushed). bf16/f16 are reduced as packed
// 16-bit pairs (__vmaxu2) and widened to fp32 once per thread (both widenings are exact).
//
// Cross-block combination needs no host sync and no scratch: the handler zeroes the 4-byte output
// (cudaMemsetAsync) and every block does one atomicMax on its uint32 pattern.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace jax_fp4 {
namespace amax {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // independent 16-byte loads in flight per thread per iteration

// Per-dtype bit tricks. All patterns below are |x| with NaN -> 0, in the dtype's own width.
struct Bf16Bits {
  using storage = uint16_t;
  static constexpr uint32_t kAbsMask2 = 0x7FFF7FFFu;  // two packed elements
  static constexpr uint32_t kInf2 = 0x7F807F80u;
  static constexpr uint32_t kAbsMask = 0x7FFFu;
  static constexpr uint32_t kInf = 0x7F80u;
  // bf16 -> fp32 is a 16-bit left shift of the pattern.
  __device__ static uint32_t ToF32Bits(uint32_t h) { return h << 16; }
};

struct F16Bits {
  using storage = uint16_t;
  static constexpr uint32_t kAbsMask2 = 0x7FFF7FFFu;
  static constexpr uint32_t kInf2 = 0x7C007C00u;
  static constexpr uint32_t kAbsMask = 0x7FFFu;
  static constexpr uint32_t kInf = 0x7C00u;
  // cvt.f32.f16 is exact (f16 subnormals are fp32 normals); no ftz involved.
  __device__ static uint32_t ToF32Bits(uint32_t h) {
    return __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(h))));
  }
};

struct F32Bits {
  using storage = uint32_t;
  static constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
  static constexpr uint32_t kInf = 0x7F800000u;
  __device__ static uint32_t ToF32Bits(uint32_t b) { return b; }
};

// |x| pattern of one element, NaN -> 0.
template <typename Bits>
__device__ __forceinline__ uint32_t AbsBits(uint32_t raw) {
  uint32_t a = raw & Bits::kAbsMask;
  return a > Bits::kInf ? 0u : a;
}

// Max-accumulate one 32-bit word of the input (two 16-bit elements, or one fp32).
template <typename Bits>
__device__ __forceinline__ uint32_t AccumulateWord(uint32_t acc, uint32_t w) {
  if constexpr (sizeof(typename Bits::storage) == 2) {
    uint32_t a = w & Bits::kAbsMask2;
    uint32_t nan = __vcmpgtu2(a, Bits::kInf2);  // 0xFFFF in each NaN half
    return __vmaxu2(acc, a & ~nan);
  } else {
    return max(acc, AbsBits<Bits>(w));
  }
}

// Per-thread accumulator (packed for 16-bit types) -> fp32 |x| pattern.
template <typename Bits>
__device__ __forceinline__ uint32_t FinishThread(uint32_t acc) {
  if constexpr (sizeof(typename Bits::storage) == 2) {
    return Bits::ToF32Bits(max(acc & 0xFFFFu, acc >> 16));
  } else {
    return acc;
  }
}

// x: n elements of Bits::storage (any alignment to sizeof(storage)); out: one fp32 already zeroed.
// Elements [0, head) and [head + 16*nvec/sizeof, n) are read one by one; the aligned middle as uint4.
template <typename Bits>
__global__ void __launch_bounds__(kThreads) AmaxKernel(const typename Bits::storage* __restrict__ x, size_t n,
                                                       size_t head, size_t nvec, unsigned int* __restrict__ out) {
  using T = typename Bits::storage;
  constexpr size_t kPerVec = 16 / sizeof(T);
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nthreads = static_cast<size_t>(gridDim.x) * blockDim.x;

  uint32_t acc = 0;      // packed accumulator for the vector body
  uint32_t scalar = 0;   // fp32 pattern accumulator for head/tail elements

  // Aligned body: kUnroll independent 16-byte streaming loads per iteration.
  const uint4* __restrict__ v = reinterpret_cast<const uint4*>(x + head);
  size_t i = tid;
  for (; i + (kUnroll - 1) * nthreads < nvec; i += kUnroll * nthreads) {
    uint4 r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = __ldcs(v + i + u * nthreads);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      acc = AccumulateWord<Bits>(acc, r[u].x);
      acc = AccumulateWord<Bits>(acc, r[u].y);
      acc = AccumulateWord<Bits>(acc, r[u].z);
      acc = AccumulateWord<Bits>(acc, r[u].w);
    }
  }
  for (; i < nvec; i += nthreads) {
    uint4 r = __ldcs(v + i);
    acc = AccumulateWord<Bits>(acc, r.x);
    acc = AccumulateWord<Bits>(acc, r.y);
    acc = AccumulateWord<Bits>(acc, r.z);
    acc = AccumulateWord<Bits>(acc, r.w);
  }

  // Head (before the first 16-byte boundary) and tail (after the last full vector): fewer than kPerVec each.
  const size_t tail_start = head + nvec * kPerVec;
  if (tid < head) scalar = Bits::ToF32Bits(AbsBits<Bits>(x[tid]));
  if (tail_start + tid < n) scalar = max(scalar, Bits::ToF32Bits(AbsBits<Bits>(x[tail_start + tid])));

  uint32_t m = max(FinishThread<Bits>(acc), scalar);

  // Block reduction: warp max, then the first warp combines the warp results.
  m = __reduce_max_sync(0xFFFFFFFFu, m);
  __shared__ uint32_t warp_max[kThreads / 32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  if (warp == 0) {
    m = lane < kThreads / 32 ? warp_max[lane] : 0u;
    m = __reduce_max_sync(0xFFFFFFFFu, m);
    if (lane == 0 && m != 0u) atomicMax(out, m);  // out starts at +0, so a zero block result is a no-op
  }
}

// Grid: enough blocks to cover the vectors once, capped at a few waves of resident blocks (grid-stride beyond).
inline unsigned int GridSize(size_t nvec, size_t head, size_t tail, int num_sms) {
  const size_t per_block = static_cast<size_t>(kThreads) * kUnroll;
  size_t blocks = (nvec + per_block - 1) / per_block;
  if (blocks == 0 && (head > 0 || tail > 0)) blocks = 1;
  const size_t cap = static_cast<size_t>(num_sms > 0 ? num_sms : 132) * 8;  // 8 resident 256-thread blocks/SM
  if (blocks > cap) blocks = cap;
  if (blocks == 0) blocks = 1;
  return static_cast<unsigned int>(blocks);
}

// Enqueues amax(|x|) into *out on `stream`: memset(0) plus (for n > 0) one kernel. Returns the launch status.
template <typename Bits>
cudaError_t LaunchAmax(const typename Bits::storage* x, size_t n, float* out, int num_sms, cudaStream_t stream) {
  using T = typename Bits::storage;
  constexpr size_t kPerVec = 16 / sizeof(T);
  cudaError_t err = cudaMemsetAsync(out, 0, sizeof(float), stream);
  if (err != cudaSuccess || n == 0) return err;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(x);
  size_t head = ((16 - (addr % 16)) % 16) / sizeof(T);
  if (head > n) head = n;
  const size_t nvec = (n - head) / kPerVec;
  const size_t tail = n - head - nvec * kPerVec;
  const unsigned int grid = GridSize(nvec, head, tail, num_sms);
  AmaxKernel<Bits><<<grid, kThreads, 0, stream>>>(x, n, head, nvec, reinterpret_cast<unsigned int*>(out));
  return cudaGetLastError();
}

}  // namespace amax
}  // namespace jax_fp4
