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
#include "common/ffi_utils.h"
#include "dequantize/dequantize.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace {

using dequantize::Args;

int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

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
  const auto dims = data.dimensions();
  JF4_CHECK(dims.size() == 3, "jf4_dequantize: data must be rank 3 [P, R, C], got rank " +
                                  std::to_string(dims.size()));
  const int64_t P = dims[0], R = dims[1], C = dims[2];
  const std::string where = "jf4_dequantize: data [" + std::to_string(P) + ", " + std::to_string(R) + ", " +
                            std::to_string(C) + "]";
  const bool nvfp4 = kind == dequantize::kNvfp4;
  JF4_CHECK(nvfp4 || kind == dequantize::kMxfp8E4m3 || kind == dequantize::kMxfp8E5m2,
            where + ": unknown kind " + std::to_string(kind));
  const ffi::DataType dtype = nvfp4 ? ffi::DataType::F4E2M1FN
                                    : (kind == dequantize::kMxfp8E4m3 ? ffi::DataType::F8E4M3FN : ffi::DataType::F8E5M2);
  JF4_CHECK(data.element_type() == dtype, where + ": data dtype " + DataTypeName(data.element_type()));
  const bool col = !nvfp4 && (flags & dequantize::kMxColumnwise);
  const bool local = nvfp4 && (flags & dequantize::k1x64);
  const bool transpose = flags & dequantize::kTransposeOut;
  JF4_CHECK(!transpose || nvfp4, where + ": only NVFP4 output is transposed");
  JF4_CHECK(!(flags & dequantize::kMxColumnwise) || !nvfp4, where + ": kMxColumnwise is for MXFP8");
  const int64_t bs = nvfp4 ? 16 : 32;
  JF4_CHECK((col ? R % bs == 0 : C % bs == 0) && (!local || C % 64 == 0),
            where + ": the block axis is not a whole number of blocks (1x64: windows)");
  const int64_t rows = col ? P * C : P * R, cols = col ? R / bs : C / bs;
  const bool swizzled = flags & dequantize::kSwizzled;
  const int64_t scale_count = swizzled ? RoundUp(rows, 128) * RoundUp(cols, 4) : rows * cols;
  JF4_CHECK(scale.element_type() == (nvfp4 ? ffi::DataType::F8E4M3FN : ffi::DataType::F8E8M0FNU),
            where + ": scale dtype " + DataTypeName(scale.element_type()));
  JF4_CHECK(static_cast<int64_t>(ElementCount(scale)) == scale_count,
            where + ": scale holds " + std::to_string(ElementCount(scale)) + " elements, expected " +
                std::to_string(scale_count));
  const int64_t amax_count = static_cast<int64_t>(ElementCount(amax));
  const bool block_only = nvfp4 && !local && amax_count == 0;  // values * block scale (the GEMM operand)
  const bool tensor_scale = nvfp4 && !local && !block_only;
  JF4_CHECK(!tensor_scale || amax_count == 1 || amax_count == P,
            where + ": NVFP4 takes its tensor amax as 1 or P floats (or none: block scales only), got " +
                std::to_string(amax_count));
  JF4_CHECK(!(flags & dequantize::kBlockOnly), where + ": kBlockOnly is set from an empty amax, not passed");
  JF4_CHECK(!local || static_cast<int64_t>(ElementCount(window_amax)) == P * R * (C / 64),
            where + ": 1x64 window amax must hold P*R*C/64 floats");
  const auto od = out->dimensions();
  JF4_CHECK(od.size() == 3 && od[0] == P && od[1] == (transpose ? C : R) && od[2] == (transpose ? R : C),
            where + ": output shape mismatch");
  if (P * R * C == 0) return ffi::Error::Success();

  Args a{};
  a.data = static_cast<const uint8_t*>(data.untyped_data());
  a.scale = static_cast<const uint8_t*>(scale.untyped_data());
  a.amax = tensor_scale ? amax.typed_data() : nullptr;
  a.amax_per_p = tensor_scale && amax_count == P && P > 1;
  a.window_amax = local ? window_amax.typed_data() : nullptr;
  a.out = out->untyped_data();
  a.P = P, a.R = R, a.C = C;
  a.flags = flags | (block_only ? dequantize::kBlockOnly : 0);
  a.scale_cols_padded = RoundUp(cols, 4);
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
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int32_t>("kind")
                                  .Attr<int32_t>("flags"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
