// FFI handler `jf4_grouped_dequantize`: one orientation's grouped NVFP4 / MXFP8 data + compact scales (+ per-group
// amax) -> f32 / bf16 / f16 values in x's layout (grouped_dequantize.cuh), group sizes read on the device only.
//
// Operands: data [size] (float4_e2m1fn / float8_e4m3fn / float8_e5m2), scale [size / block] (float8_e4m3fn NVFP4,
// float8_e8m0fnu MXFP8), amax f32[N] (NVFP4 unless raw, else f32[0]), first_dims and last_dims int32[N], then any
// number of ignored operands (a test aliases a poisoned buffer to the result). Result: out [x_shape] (size elements,
// any shape). Attributes: kind (dequantize::Kind), flags (codes::grouped_dequantize: kColumnwise | kRht | kRaw). Every
// size is checked (common/ffi_grouped_checks.h), so a mismatched call is an InvalidArgument error, never an
// out-of-bounds access. Command-buffer compatible: one launch, no host sync, no allocation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/errors.h"
#include "common/ffi_codes.h"
#include "common/ffi_grouped_checks.h"
#include "common/ffi_utils.h"
#include "grouped/group_table.cuh"
#include "grouped/grouped_dequantize.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace {

template <typename Out, int kKind, int kTiles = grouped::kNoTiles>
ffi::Error Launch(const grouped::DequantArgs& a, cudaStream_t stream) {
  const size_t smem = grouped::TableBytes(a.n);
  unsigned grid = 0;
  JF4_CUDA_CHECK(grouped::PersistentGrid(grouped::GroupedDequantizeKernel<Out, kKind, kTiles>, smem, &grid));
  grouped::GroupedDequantizeKernel<Out, kKind, kTiles><<<grid, grouped::kThreads, smem, stream>>>(a);
  JF4_CUDA_CHECK(cudaGetLastError());
  return ffi::Error::Success();
}

template <typename Out>
ffi::Error LaunchKind(int kind, const grouped::DequantArgs& a, cudaStream_t stream) {
  switch (kind) {
    case dequantize::kNvfp4:  // columnwise: the transposed-tile instantiation of the call's variant
      if (a.col && a.rht && !a.raw) return Launch<Out, dequantize::kNvfp4, dequantize::kTransposeRht>(a, stream);
      if (a.col) return Launch<Out, dequantize::kNvfp4, dequantize::kTransposePlain>(a, stream);
      return Launch<Out, dequantize::kNvfp4>(a, stream);
    case dequantize::kMxfp8E4m3: return Launch<Out, dequantize::kMxfp8E4m3>(a, stream);
    default: return Launch<Out, dequantize::kMxfp8E5m2>(a, stream);
  }
}

ffi::Error GroupedDequantizeImpl(cudaStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scale,
                                 ffi::Buffer<ffi::F32> amax, ffi::Buffer<ffi::S32> first_dims,
                                 ffi::Buffer<ffi::S32> last_dims, ffi::RemainingArgs,
                                 ffi::Result<ffi::AnyBuffer> out, int32_t kind, int32_t flags) {
  checks::GroupedDequantizeCall c;
  JF4_RETURN_IF_ERROR(checks::CheckGroupedDequantize(data, scale, amax, first_dims, last_dims, *out, kind, flags,
                                                     grouped::kMaxGroups, &c));
  grouped::DequantArgs a{};
  a.data = static_cast<const uint8_t*>(data.untyped_data());
  a.scale = static_cast<const uint8_t*>(scale.untyped_data());
  a.amax = c.tensor_scale ? amax.typed_data() : nullptr;
  a.out = out->untyped_data();
  a.size = c.size;
  a.n = static_cast<int>(c.n);
  a.first_dims = first_dims.typed_data();
  a.last_dims = last_dims.typed_data();
  a.col = c.col;
  a.rht = c.rht;
  a.raw = c.raw;
  a.bound256 = c.bound256;
  if (c.size == 0) return ffi::Error::Success();
  switch (c.out_type) {
    case ffi::DataType::F32: return LaunchKind<float>(kind, a, stream);
    case ffi::DataType::BF16: return LaunchKind<__nv_bfloat16>(kind, a, stream);
    default: return LaunchKind<__half>(kind, a, stream);
  }
}

}  // namespace
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(jf4_grouped_dequantize, jax_fp4::GroupedDequantizeImpl,
                              jax_fp4::checks::GroupedDequantizeSignature(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
