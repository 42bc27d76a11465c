// FFI handler `jf4_quantize`: rowwise and/or columnwise NVFP4 / MXFP8 quantization of x[P, M, K] (quantize.cuh).
//
// Operands: x (bf16/f16/f32 [P, M, K]), amax_row f32[P], amax_col f32[P], key_row u32[2 or 8], key_col u32[2 or 8],
// then any number of extra operands that are ignored (tests alias poisoned buffers to the results through them).
// A key of 2 words is the Philox key of stochastic rounding (this call's data is the whole tensor); 8 words are a
// shard's stream: the key, then the shard's offsets and the global dims of that orientation's stored data
// (quantize::Args::stream_row; built on the device by the sharding rule, so no host sync and no new attribute).
// Results (7, placeholders of 0 elements where unused): row_data, row_scale, row_wamax, col_data, col_scale,
// col_wamax, dbias. Attributes (common/ffi_codes.h): row_kind, col_kind (codes::Kind), flags (row options | col
// options << 8 | swizzled << 16 | dbias << 17 | row exact << 18 | col exact << 19; an exact orientation's data
// result is bf16, see quantize::Args::row_exact). Shapes are those of jax_fp4/_src/primitives/quantize.py; every one is checked
// here, so a mismatched call is an InvalidArgument error, never an out-of-bounds write.
// Command-buffer compatible: one optional cudaMemsetAsync (swizzled padding) and one kernel launch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/errors.h"
#include "common/ffi_checks.h"
#include "common/ffi_codes.h"
#include "common/ffi_utils.h"
#include "quantize/quantize.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace {

using quantize::Args;

using checks::kShardKeyWords;
using checks::Shape;

// Validates one orientation's three results (common/ffi_checks.h) and fills its pointers; `needs_zeroing` is set
// when swizzled scales have padding.
ffi::Error SetupOrientation(int kind, int opts, bool col, bool exact, bool swizzled, int64_t P, int64_t M, int64_t K,
                            ffi::AnyBuffer data, ffi::AnyBuffer scale, ffi::AnyBuffer wamax, uint8_t** data_ptr,
                            uint8_t** scale_ptr, float** wamax_ptr, int64_t* cols_padded, bool* needs_zeroing) {
  checks::QuantizeResults res;
  JF4_RETURN_IF_ERROR(
      checks::CheckQuantizeOrientation(kind, opts, col, exact, swizzled, P, M, K, data, scale, wamax, &res));
  if (kind == quantize::kNone) return ffi::Error::Success();
  if (swizzled) *cols_padded = res.cols_padded;
  *needs_zeroing = *needs_zeroing || (swizzled && res.padded);
  *data_ptr = res.data, *scale_ptr = res.scale, *wamax_ptr = res.wamax;
  return ffi::Error::Success();
}

template <typename In, int kRow>
cudaError_t LaunchCol(int col_kind, const Args& args, cudaStream_t stream) {
  switch (col_kind) {
    case quantize::kNone: return quantize::Launch<In, kRow, quantize::kNone>(args, stream);
    case quantize::kNvfp4: return quantize::Launch<In, kRow, quantize::kNvfp4>(args, stream);
    case quantize::kMxfp8E4m3: return quantize::Launch<In, kRow, quantize::kMxfp8E4m3>(args, stream);
    default: return quantize::Launch<In, kRow, quantize::kMxfp8E5m2>(args, stream);
  }
}

template <typename In>
cudaError_t LaunchFor(int row_kind, int col_kind, const Args& args, cudaStream_t stream) {
  switch (row_kind) {
    case quantize::kNone: return LaunchCol<In, quantize::kNone>(col_kind, args, stream);
    case quantize::kNvfp4: return LaunchCol<In, quantize::kNvfp4>(col_kind, args, stream);
    case quantize::kMxfp8E4m3:
      return col_kind == quantize::kNone ? quantize::Launch<In, quantize::kMxfp8E4m3, quantize::kNone>(args, stream)
                                         : quantize::Launch<In, quantize::kMxfp8E4m3, quantize::kMxfp8E4m3>(args, stream);
    default:
      return col_kind == quantize::kNone ? quantize::Launch<In, quantize::kMxfp8E5m2, quantize::kNone>(args, stream)
                                         : quantize::Launch<In, quantize::kMxfp8E5m2, quantize::kMxfp8E5m2>(args, stream);
  }
}

ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax_row,
                        ffi::Buffer<ffi::F32> amax_col, ffi::Buffer<ffi::U32> key_row, ffi::Buffer<ffi::U32> key_col,
                        ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> row_data, ffi::Result<ffi::AnyBuffer> row_scale,
                        ffi::Result<ffi::AnyBuffer> row_wamax, ffi::Result<ffi::AnyBuffer> col_data,
                        ffi::Result<ffi::AnyBuffer> col_scale, ffi::Result<ffi::AnyBuffer> col_wamax,
                        ffi::Result<ffi::AnyBuffer> dbias, int32_t row_kind, int32_t col_kind, int32_t flags) {
  int64_t P = 0, M = 0, K = 0;
  JF4_RETURN_IF_ERROR(checks::CheckQuantizeOperands(x, ElementCount(amax_row), ElementCount(amax_col),
                                                    ElementCount(key_row), ElementCount(key_col), row_kind, col_kind,
                                                    flags, &P, &M, &K));
  JF4_CHECK(P <= 65535 && (M + 63) / 64 <= 65535 && (K + 63) / 64 <= (int64_t(1) << 31) - 1,
            "jf4_quantize: x " + Shape(P, M, K) + " exceeds the kernel's grid (P <= 65535, M <= 4194240)");
  const bool swizzled = flags & codes::quantize::kSwizzled, with_dbias = flags & codes::quantize::kDbias;

  Args a{};
  a.x = x.untyped_data();
  a.P = P, a.M = M, a.K = K;
  a.amax_row = amax_row.typed_data(), a.amax_col = amax_col.typed_data();
  a.key_row = key_row.typed_data(), a.key_col = key_col.typed_data();
  a.stream_row = ElementCount(key_row) == kShardKeyWords ? a.key_row + 2 : nullptr;
  a.stream_col = ElementCount(key_col) == kShardKeyWords ? a.key_col + 2 : nullptr;
  a.row_opts = flags & codes::quantize::kOptionMask;
  a.col_opts = (flags >> codes::quantize::kColShift) & codes::quantize::kOptionMask;
  a.swizzled = swizzled;
  a.row_exact = flags & codes::quantize::kRowExact, a.col_exact = flags & codes::quantize::kColExact;
  bool zero_row = false, zero_col = false;
  JF4_RETURN_IF_ERROR(SetupOrientation(row_kind, a.row_opts, false, a.row_exact, swizzled, P, M, K, *row_data,
                                       *row_scale, *row_wamax, &a.row_data, &a.row_scale, &a.row_wamax,
                                       &a.row_scale_cols_padded, &zero_row));
  JF4_RETURN_IF_ERROR(SetupOrientation(col_kind, a.col_opts, true, a.col_exact, swizzled, P, M, K, *col_data,
                                       *col_scale, *col_wamax, &a.col_data, &a.col_scale, &a.col_wamax,
                                       &a.col_scale_cols_padded, &zero_col));
  JF4_RETURN_IF_ERROR(checks::CheckDbias(*dbias, flags, P, M, K));
  a.dbias = with_dbias ? static_cast<float*>(dbias->untyped_data()) : nullptr;

  // Padding of swizzled scales is part of the output (zero bytes): written before the kernel fills the rest.
  if (zero_row) JF4_CUDA_CHECK(cudaMemsetAsync(a.row_scale, 0, row_scale->size_bytes(), stream));
  if (zero_col) JF4_CUDA_CHECK(cudaMemsetAsync(a.col_scale, 0, col_scale->size_bytes(), stream));
  if (P * M * K == 0) return ffi::Error::Success();
  JF4_CHECK(x.untyped_data() != nullptr, "jf4_quantize: null input buffer");

  return DispatchFloat(x.element_type(), "jf4_quantize: x", [&](auto tag) -> ffi::Error {
    using Tag = decltype(tag);
    using In = std::conditional_t<Tag::kDataType == ffi::DataType::BF16, __nv_bfloat16,
                                  std::conditional_t<Tag::kDataType == ffi::DataType::F16, __half, float>>;
    a.vector_loads = (K * int64_t(sizeof(In))) % 16 == 0 && reinterpret_cast<uintptr_t>(a.x) % 16 == 0;
    JF4_CUDA_CHECK((LaunchFor<In>(row_kind, col_kind, a, stream)));
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(jf4_quantize, jax_fp4::QuantizeImpl,
                              jax_fp4::checks::QuantizeSignature(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
