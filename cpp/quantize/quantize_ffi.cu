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
#include "common/ffi_codes.h"
#include "common/ffi_utils.h"
#include "quantize/quantize.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace {

using quantize::Args;

// Words of a shard's stochastic-rounding stream (quantize.py SHARD_KEY_WORDS): k0, k1, 3 offsets, 3 global dims.
constexpr size_t kShardKeyWords = 8;

int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

std::string Shape(int64_t a, int64_t b, int64_t c) {
  return "[" + std::to_string(a) + ", " + std::to_string(b) + ", " + std::to_string(c) + "]";
}

int BlockSize(int kind) { return kind == quantize::kNvfp4 ? 16 : 32; }

ffi::DataType DataType(int kind) {
  switch (kind) {
    case quantize::kNvfp4: return ffi::DataType::F4E2M1FN;
    case quantize::kMxfp8E4m3: return ffi::DataType::F8E4M3FN;
    default: return ffi::DataType::F8E5M2;
  }
}

ffi::DataType ScaleType(int kind) {
  return kind == quantize::kNvfp4 ? ffi::DataType::F8E4M3FN : ffi::DataType::F8E8M0FNU;
}

ffi::Error CheckBuffer(const ffi::AnyBuffer& b, ffi::DataType dtype, int64_t count, const std::string& what) {
  JF4_CHECK(b.element_type() == dtype, what + ": expected " + DataTypeName(dtype) + ", got " +
                                           DataTypeName(b.element_type()));
  JF4_CHECK(static_cast<int64_t>(ElementCount(b)) == count,
            what + ": expected " + std::to_string(count) + " elements, got " + std::to_string(ElementCount(b)));
  JF4_CHECK(count == 0 || b.untyped_data() != nullptr, what + ": null buffer");
  return ffi::Error::Success();
}

// Validates one orientation's three results and fills its pointers. `col` selects the columnwise geometry.
ffi::Error SetupOrientation(int kind, int opts, bool col, bool exact, bool swizzled, int64_t P, int64_t M, int64_t K,
                            ffi::AnyBuffer data, ffi::AnyBuffer scale, ffi::AnyBuffer wamax, uint8_t** data_ptr,
                            uint8_t** scale_ptr, float** wamax_ptr, int64_t* cols_padded, bool* needs_zeroing) {
  const std::string side = col ? "columnwise" : "rowwise";
  if (kind == quantize::kNone) {
    JF4_CHECK(!exact, side + ": exact operand requested without a format");
    return ffi::Error::Success();
  }
  JF4_CHECK(kind == quantize::kNvfp4 || kind == quantize::kMxfp8E4m3 || kind == quantize::kMxfp8E5m2,
            side + ": unknown format kind " + std::to_string(kind));
  const int64_t bs = BlockSize(kind);
  const int64_t blocked = col ? M : K;
  JF4_CHECK(blocked % bs == 0, side + ": block axis of x " + Shape(P, M, K) + " is not a multiple of " +
                                   std::to_string(bs));
  const bool nvfp4 = kind == quantize::kNvfp4;
  const bool local = nvfp4 && (opts & quantize::k1x64);
  if (local) JF4_CHECK(blocked % 64 == 0, side + ": 1x64 needs the block axis % 64 == 0, x " + Shape(P, M, K));
  if (nvfp4 && (opts & quantize::k2d)) {
    JF4_CHECK((col ? K : M) % 16 == 0, side + ": 2D scaling needs 16x16 tiles inside each x[p], x " + Shape(P, M, K));
  }
  JF4_CHECK(!(exact && local), side + ": no exact operand for 1x64 (its window scales do not factor out)");
  JF4_RETURN_IF_ERROR(CheckBuffer(data, exact ? ffi::DataType::BF16 : DataType(kind), P * M * K, side + " data"));
  const int64_t rows = P * (col ? K : M);  // scale-matrix rows (MXFP8 columnwise viewed transposed)
  const int64_t cols = blocked / bs;
  int64_t scale_count = rows * cols;
  if (swizzled) {
    *cols_padded = RoundUp(cols, 4);
    scale_count = RoundUp(rows, 128) * *cols_padded;
    *needs_zeroing = *needs_zeroing || (scale_count != rows * cols);
  }
  JF4_RETURN_IF_ERROR(CheckBuffer(scale, ScaleType(kind), scale_count, side + " scale"));
  JF4_RETURN_IF_ERROR(CheckBuffer(wamax, ffi::DataType::F32, local ? rows * (blocked / 64) : 0, side + " window amax"));
  *data_ptr = static_cast<uint8_t*>(data.untyped_data());
  *scale_ptr = static_cast<uint8_t*>(scale.untyped_data());
  *wamax_ptr = local ? static_cast<float*>(wamax.untyped_data()) : nullptr;
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

// Supported pairings (the Python lowering splits any other pairing into two calls).
bool Supported(int row_kind, int col_kind) {
  if (row_kind == quantize::kNone || col_kind == quantize::kNone) return row_kind != col_kind;
  if (row_kind == quantize::kNvfp4) return true;  // NVFP4 rowwise with any columnwise format
  return row_kind == col_kind;                    // MXFP8 rowwise with the same MXFP8 columnwise
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
  const auto dims = x.dimensions();
  JF4_CHECK(dims.size() == 3, "jf4_quantize: x must be rank 3 [P, M, K], got rank " + std::to_string(dims.size()));
  const int64_t P = dims[0], M = dims[1], K = dims[2];
  JF4_CHECK(Supported(row_kind, col_kind), "jf4_quantize: unsupported format pairing row_kind " +
                                               std::to_string(row_kind) + ", col_kind " + std::to_string(col_kind));
  JF4_CHECK(static_cast<int64_t>(ElementCount(amax_row)) == P && static_cast<int64_t>(ElementCount(amax_col)) == P,
            "jf4_quantize: amax operands must hold P = " + std::to_string(P) + " floats");
  const auto key_ok = [](size_t n) { return n == 2 || n == kShardKeyWords; };
  JF4_CHECK(key_ok(ElementCount(key_row)) && key_ok(ElementCount(key_col)),
            "jf4_quantize: keys must be uint32[2] (Philox key) or uint32[8] (a shard's stream words), got " +
                std::to_string(ElementCount(key_row)) + " and " + std::to_string(ElementCount(key_col)) + " words");
  JF4_CHECK(P <= 65535 && (M + 63) / 64 <= 65535 && (K + 63) / 64 <= (int64_t(1) << 31) - 1,
            "jf4_quantize: x " + Shape(P, M, K) + " exceeds the kernel's grid (P <= 65535, M <= 4194240)");
  const bool swizzled = flags & codes::quantize::kSwizzled, with_dbias = flags & codes::quantize::kDbias;
  JF4_CHECK(!with_dbias || col_kind != quantize::kNone, "jf4_quantize: dbias needs a columnwise output");

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
  JF4_RETURN_IF_ERROR(CheckBuffer(*dbias, ffi::DataType::F32, with_dbias ? P * ((M + 63) / 64) * K : 0, "dbias"));
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
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .RemainingArgs()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int32_t>("row_kind")
                                  .Attr<int32_t>("col_kind")
                                  .Attr<int32_t>("flags"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
