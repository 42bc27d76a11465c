// FFI handler `jf4_rht_amax`: out[p] = fmax |RHT(x[p])| for x bf16/f16/f32 [P, M, K], the transform applied to
// 16-chunks along K (attribute col = 0) or along M (col = 1), bf16-rounded as quantize sees it (reference/rht.py).
// One read of x: 64x64 tiles, a block-wide max, then one atomicMax per block on the fp32 bit pattern (non-negative
// floats order like their bits) into out, which is zeroed first with cudaMemsetAsync. No host sync, no scratch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/convert.cuh"
#include "common/errors.h"
#include "common/ffi_utils.h"
#include "quantize/quantize.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace {

constexpr int kTile = quantize::kTile, kThreads = quantize::kThreads;

template <typename In, bool kCol>
__global__ void __launch_bounds__(kThreads) RhtAmaxKernel(const In* __restrict__ x, int64_t M, int64_t K,
                                                          bool vector, uint32_t* out) {
  __shared__ float tile[kCol ? kTile : 1][kTile + 1];
  __shared__ float warp_max[kThreads / 32];
  const int t = threadIdx.x;
  const int64_t p = blockIdx.z, m0 = int64_t(blockIdx.y) * kTile, k0 = int64_t(blockIdx.x) * kTile;
  x += p * M * K;
  const int lr = t >> 2, cg = t & 3;
  const int64_t m = m0 + lr, k = k0 + cg * 16;
  const int valid = (m < M && k < K) ? int(K - k < 16 ? K - k : 16) : 0;
  float v[16];
  quantize::Load16<In>(x + m * K + k, valid, vector, v);
  if constexpr (kCol) {
#pragma unroll
    for (int i = 0; i < 16; ++i) tile[lr][cg * 16 + i] = v[i];
    __syncthreads();
    const int lc = t & 63, rb = t >> 6;
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = tile[rb * 16 + i][lc];
  }
  // Padding zeros transform to zeros, so partial tiles need no masking.
  cvt::RhtForward16(v);
  float mx = quantize::Max16(v);
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, s));
  if ((t & 31) == 0) warp_max[t >> 5] = mx;
  __syncthreads();
  if (t == 0) {
    float b = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) b = fmaxf(b, warp_max[w]);
    atomicMax(out + p, __float_as_uint(b));
  }
}

ffi::Error RhtAmaxImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::F32>> out,
                       int32_t col) {
  const auto dims = x.dimensions();
  JF4_CHECK(dims.size() == 3, "jf4_rht_amax: x must be rank 3 [P, M, K], got rank " + std::to_string(dims.size()));
  const int64_t P = dims[0], M = dims[1], K = dims[2];
  JF4_CHECK(static_cast<int64_t>(ElementCount(*out)) == P, "jf4_rht_amax: output must hold P floats");
  JF4_CHECK((col ? M : K) % 16 == 0, "jf4_rht_amax: the transformed axis is not a multiple of 16");
  JF4_CHECK(P <= 65535 && (M + 63) / 64 <= 65535, "jf4_rht_amax: x exceeds the kernel's grid");
  if (P == 0) return ffi::Error::Success();
  JF4_CUDA_CHECK(cudaMemsetAsync(out->typed_data(), 0, P * sizeof(float), stream));
  if (M * K == 0) return ffi::Error::Success();
  uint32_t* o = reinterpret_cast<uint32_t*>(out->typed_data());
  const dim3 grid(unsigned((K + kTile - 1) / kTile), unsigned((M + kTile - 1) / kTile), unsigned(P));
  return DispatchFloat(x.element_type(), "jf4_rht_amax: x", [&](auto tag) -> ffi::Error {
    using Tag = decltype(tag);
    using In = std::conditional_t<Tag::kDataType == ffi::DataType::BF16, __nv_bfloat16,
                                  std::conditional_t<Tag::kDataType == ffi::DataType::F16, __half, float>>;
    const In* xp = static_cast<const In*>(x.untyped_data());
    const bool vector = (K * int64_t(sizeof(In))) % 16 == 0 && reinterpret_cast<uintptr_t>(xp) % 16 == 0;
    if (col) RhtAmaxKernel<In, true><<<grid, kThreads, 0, stream>>>(xp, M, K, vector, o);
    else RhtAmaxKernel<In, false><<<grid, kThreads, 0, stream>>>(xp, M, K, vector, o);
    JF4_CUDA_CHECK(cudaGetLastError());
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(jf4_rht_amax, jax_fp4::RhtAmaxImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int32_t>("col"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
