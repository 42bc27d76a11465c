// FFI handler `jf4_dequantize`: NVFP4 / MXFP8 data [P, R, C] + scales (+ amax / window amax) -> f32/bf16/f16.
//
// Operands: data (float4_e2m1fn / float8_e4m3fn / float8_e5m2 [P, R, C]), scale (float8_e4m3fn for NVFP4,
// float8_e8m0fnu for MXFP8; compact, or the swizzled padded scale matrix), amax f32[1] or f32[P] (NVFP4 with a
// tensor scale; f32[0] for NVFP4 1D/2D gives value * block scale only, the exact GEMM-emulation operand; else
// f32[0]), window_amax f32[P, R, C/64] (NVFP4 1x64, else f32[0]); further operands are accepted
// and ignored (RemainingArgs: a test aliases a poisoned buffer to the result). Result: out [P, R, C], or [P, C, R]
// when flags has kTransposeOut (NVFP4 whose block axis is not x's last axis). Attributes: kind (dequantize::Kind),
// flags (dequantize::Option bits). Every size is checked against the geometry, so a mismatched call is an
// InvalidArgument error, never an out-of-bounds access. An empty tensor launches nothing. Command-buffer
// compatible: one launch, no host sync, no allocation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/errors.h"
#include "common/ffi_checks.h"
#include "common/ffi_utils.h"
#include "dequantize/dequantize.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace {

using dequantize::Args;

template <typename Out>
cudaError_t LaunchKind(int kind, const Args& a, cudaStream_t stream) {
  switch (kind) {
    case dequantize::kNvfp4: return dequantize::Launch<Out, dequantize::kNvfp4>(a, stream);
    case dequantize::kMxfp8E4m3: return dequantize::Launch<Out, dequantize::kMxfp8E4m3>(a, stream);
    default: return dequantize::Launch<Out, dequantize::kMxfp8E5m2>(a, stream);
  }
}

ffi::Error DequantizeImpl(cudaStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scale,
                          ffi::Buffer<ffi::F32> amax, ffi::Buffer<ffi::F32> window_amax, ffi::RemainingArgs,
                          ffi::Result<ffi::AnyBuffer> out, int32_t kind, int32_t flags) {
  checks::DequantizeGeometry g;
  JF4_RETURN_IF_ERROR(checks::CheckDequantize(data, scale, ElementCount(amax), ElementCount(window_amax), *out, kind,
                                              flags, &g));
  const int64_t P = g.P, R = g.R, C = g.C;
  const std::string& where = g.where;
  if (P * R * C == 0) return ffi::Error::Success();

  Args a{};
  a.data = static_cast<const uint8_t*>(data.untyped_data());
  a.scale = static_cast<const uint8_t*>(scale.untyped_data());
  a.amax = g.tensor_scale ? amax.typed_data() : nullptr;
  a.amax_per_p = g.amax_per_p;
  a.window_amax = g.local ? window_amax.typed_data() : nullptr;
  a.out = out->untyped_data();
  a.P = P, a.R = R, a.C = C;
  a.flags = flags | (g.block_only ? dequantize::kBlockOnly : 0);
  a.scale_cols_padded = g.cols_padded;
  JF4_CHECK(a.data != nullptr && a.scale != nullptr && a.out != nullptr, where + ": null buffer");
  switch (out->element_type()) {
    case ffi::DataType::F32: JF4_CUDA_CHECK(LaunchKind<float>(kind, a, stream)); break;
    case ffi::DataType::BF16: JF4_CUDA_CHECK(LaunchKind<__nv_bfloat16>(kind, a, stream)); break;
    case ffi::DataType::F16: JF4_CUDA_CHECK(LaunchKind<__half>(kind, a, stream)); break;
    default:
      return ffi::Error::InvalidArgument(where + ": output dtype " + DataTypeName(out->element_type()) +
                                         " (expected float32, bfloat16 or float16)");
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(jf4_dequantize, jax_fp4::DequantizeImpl,
                              jax_fp4::checks::DequantizeSignature(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
