// FFI handler `jf4_grouped_quantize`: rowwise and/or columnwise NVFP4 / MXFP8 quantization of N groups held in one
// buffer (grouped_quantize.cuh), group sizes read on the device only.
//
// Operands: x (bf16/f16/f32, any shape, read flat: group g is [M_g, K_g] row-major at offsets[g]), first_dims and
// last_dims int32[N] (M_g, K_g), key_row and key_col uint32[N, 2] (per-group Philox key words of stochastic
// rounding), amax_in f32[2N] or [0] (given per-group NVFP4 tensor amaxes, row then column), then any number of ignored
// operands (tests alias poisoned buffers to the results through them).
// Results (7; placeholders of 0 elements where an orientation is absent): row_data [size], row_scale [size / block],
// row_amax f32[N] (NVFP4, else [0]), col_data, col_scale, col_amax, and scratch f32[2N + 1] (the computed per-group
// amaxes, row then column, then the quantize kernel's scheduling counter as int32 bits; f32[1] without NVFP4). Attributes: row_kind, col_kind (quantize::Kind), flags (row options |
// col options << 8; NVFP4 kSr / kRht only), amax_given (bit 0: the rowwise, bit 1: the columnwise NVFP4 amaxes come
// from amax_in, which must then be f32[2N], and the quantize kernel reads them there; the others are computed). Every
// size is checked, so a mismatched call is an InvalidArgument error. Command-buffer compatible: a cudaMemsetAsync of the scratch
// (with NVFP4 amaxes to compute) or of its counter word, the per-group amax kernel where amaxes are computed, then the
// quantize kernel; no host sync, no allocation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "common/errors.h"
#include "common/ffi_codes.h"
#include "common/ffi_utils.h"
#include "grouped/group_table.cuh"
#include "grouped/grouped_amax.cuh"
#include "grouped/grouped_quantize.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace {

using grouped::QuantArgs;

ffi::DataType DataType(int kind) {
  switch (kind) {
    case quantize::kNvfp4: return ffi::DataType::F4E2M1FN;
    case quantize::kMxfp8E4m3: return ffi::DataType::F8E4M3FN;
    default: return ffi::DataType::F8E5M2;
  }
}

ffi::Error CheckBuffer(const ffi::AnyBuffer& b, ffi::DataType dtype, int64_t count, const std::string& what) {
  if (count == 0) {  // placeholder: any dtype
    JF4_CHECK(ElementCount(b) == 0, what + ": expected an empty placeholder, got " + std::to_string(ElementCount(b)) +
                                        " elements");
    return ffi::Error::Success();
  }
  JF4_CHECK(b.element_type() == dtype, what + ": expected " + DataTypeName(dtype) + ", got " +
                                           DataTypeName(b.element_type()));
  JF4_CHECK(static_cast<int64_t>(ElementCount(b)) == count,
            what + ": expected " + std::to_string(count) + " elements, got " + std::to_string(ElementCount(b)));
  JF4_CHECK(b.untyped_data() != nullptr, what + ": null buffer");
  return ffi::Error::Success();
}

// Validates one orientation's results and fills its pointers.
ffi::Error Orientation(int kind, int opts, const std::string& side, int64_t size, int64_t n, ffi::AnyBuffer data,
                       ffi::AnyBuffer scale, ffi::AnyBuffer amax, uint8_t** data_ptr, uint8_t** scale_ptr,
                       float** amax_ptr) {
  if (kind == quantize::kNone) {
    JF4_RETURN_IF_ERROR(CheckBuffer(data, ffi::DataType::U8, 0, side + " data"));
    JF4_RETURN_IF_ERROR(CheckBuffer(scale, ffi::DataType::U8, 0, side + " scale"));
    return CheckBuffer(amax, ffi::DataType::F32, 0, side + " amax");
  }
  JF4_CHECK(kind == quantize::kNvfp4 || kind == quantize::kMxfp8E4m3 || kind == quantize::kMxfp8E5m2,
            side + ": unknown format kind " + std::to_string(kind));
  const bool nvfp4 = kind == quantize::kNvfp4;
  JF4_CHECK((opts & ~(quantize::kSr | quantize::kRht)) == 0 && (nvfp4 || opts == 0),
            side + ": unsupported options " + std::to_string(opts) + " (grouped: NVFP4 1D with SR / RHT, MXFP8)");
  const int64_t bs = nvfp4 ? 16 : 32;
  JF4_RETURN_IF_ERROR(CheckBuffer(data, DataType(kind), size, side + " data"));
  JF4_RETURN_IF_ERROR(CheckBuffer(scale, nvfp4 ? ffi::DataType::F8E4M3FN : ffi::DataType::F8E8M0FNU, size / bs,
                                  side + " scale"));
  JF4_RETURN_IF_ERROR(CheckBuffer(amax, ffi::DataType::F32, nvfp4 ? n : 0, side + " amax"));
  *data_ptr = static_cast<uint8_t*>(data.untyped_data());
  *scale_ptr = static_cast<uint8_t*>(scale.untyped_data());
  *amax_ptr = nvfp4 ? static_cast<float*>(amax.untyped_data()) : nullptr;
  return ffi::Error::Success();
}

// One launch serves one orientation alone, NVFP4 rowwise with any columnwise format, or MXFP8 with the same MXFP8
// (the Python lowering splits any other pairing into two calls).
bool Supported(int row_kind, int col_kind) {
  if (row_kind == quantize::kNone || col_kind == quantize::kNone) return row_kind != col_kind;
  return row_kind == quantize::kNvfp4 || row_kind == col_kind;
}

template <typename In, int kRow, int kCol>
ffi::Error LaunchPair(const QuantArgs& a, bool amax_pass, const grouped::AmaxArgs& am, cudaStream_t stream) {
  if constexpr (kRow == quantize::kNone && kCol == quantize::kNone) {
    return ffi::Error::InvalidArgument("jf4_grouped_quantize: no orientation requested");
  } else {
    if (amax_pass) JF4_CUDA_CHECK(grouped::LaunchAmax<In>(am, stream));
    JF4_CUDA_CHECK((grouped::LaunchQuantize<In, kRow, kCol>(a, stream)));
    return ffi::Error::Success();
  }
}

template <typename In, int kRow>
ffi::Error LaunchCol(int col_kind, const QuantArgs& a, bool amax_pass, const grouped::AmaxArgs& am,
                     cudaStream_t stream) {
  switch (col_kind) {
    case quantize::kNone: return LaunchPair<In, kRow, quantize::kNone>(a, amax_pass, am, stream);
    case quantize::kNvfp4: return LaunchPair<In, kRow, quantize::kNvfp4>(a, amax_pass, am, stream);
    case quantize::kMxfp8E4m3: return LaunchPair<In, kRow, quantize::kMxfp8E4m3>(a, amax_pass, am, stream);
    default: return LaunchPair<In, kRow, quantize::kMxfp8E5m2>(a, amax_pass, am, stream);
  }
}

template <typename In>
ffi::Error LaunchFor(int row_kind, int col_kind, const QuantArgs& a, bool amax_pass, const grouped::AmaxArgs& am,
                     cudaStream_t stream) {
  using quantize::kMxfp8E4m3;
  using quantize::kMxfp8E5m2;
  using quantize::kNone;
  switch (row_kind) {
    case kNone: return LaunchCol<In, kNone>(col_kind, a, amax_pass, am, stream);
    case quantize::kNvfp4: return LaunchCol<In, quantize::kNvfp4>(col_kind, a, amax_pass, am, stream);
    case kMxfp8E4m3:
      return col_kind == kNone ? LaunchPair<In, kMxfp8E4m3, kNone>(a, amax_pass, am, stream)
                               : LaunchPair<In, kMxfp8E4m3, kMxfp8E4m3>(a, amax_pass, am, stream);
    default:
      return col_kind == kNone ? LaunchPair<In, kMxfp8E5m2, kNone>(a, amax_pass, am, stream)
                               : LaunchPair<In, kMxfp8E5m2, kMxfp8E5m2>(a, amax_pass, am, stream);
  }
}

ffi::Error GroupedQuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> first_dims,
                               ffi::Buffer<ffi::S32> last_dims, ffi::Buffer<ffi::U32> key_row,
                               ffi::Buffer<ffi::U32> key_col, ffi::Buffer<ffi::F32> amax_in, ffi::RemainingArgs,
                               ffi::Result<ffi::AnyBuffer> row_data, ffi::Result<ffi::AnyBuffer> row_scale,
                               ffi::Result<ffi::AnyBuffer> row_amax, ffi::Result<ffi::AnyBuffer> col_data,
                               ffi::Result<ffi::AnyBuffer> col_scale, ffi::Result<ffi::AnyBuffer> col_amax,
                               ffi::Result<ffi::Buffer<ffi::F32>> scratch, int32_t row_kind, int32_t col_kind,
                               int32_t flags, int32_t amax_given) {
  const int64_t size = static_cast<int64_t>(ElementCount(x));
  const int64_t n = static_cast<int64_t>(ElementCount(first_dims));
  const std::string where = "jf4_grouped_quantize: x of " + std::to_string(size) + " elements, " +
                            std::to_string(n) + " groups";
  JF4_CHECK(size < (int64_t(1) << 31), where + ": x must have fewer than 2**31 elements");
  JF4_CHECK(n >= 1 && n <= grouped::kMaxGroups, where + ": the kernel takes 1.." +
                                                    std::to_string(grouped::kMaxGroups) + " groups");
  JF4_CHECK(static_cast<int64_t>(ElementCount(last_dims)) == n, where + ": last_dims must hold N int32");
  const int64_t kr = static_cast<int64_t>(ElementCount(key_row)), kc = static_cast<int64_t>(ElementCount(key_col));
  JF4_CHECK(kr == 2 * n && kc == 2 * n, where + ": keys must be uint32[N, 2]");
  JF4_CHECK(Supported(row_kind, col_kind), where + ": unsupported format pairing row_kind " +
                                               std::to_string(row_kind) + ", col_kind " + std::to_string(col_kind));

  QuantArgs a{};
  a.x = x.untyped_data();
  a.size = size;
  a.n = static_cast<int>(n);
  a.first_dims = first_dims.typed_data();
  a.last_dims = last_dims.typed_data();
  a.key_row = key_row.typed_data();
  a.key_col = key_col.typed_data();
  a.row_opts = flags & codes::quantize::kOptionMask;
  a.col_opts = (flags >> codes::quantize::kColShift) & codes::quantize::kOptionMask;
  JF4_RETURN_IF_ERROR(Orientation(row_kind, a.row_opts, where + " rowwise", size, n, *row_data, *row_scale,
                                  *row_amax, &a.row_data, &a.row_scale, &a.row_amax));
  JF4_RETURN_IF_ERROR(Orientation(col_kind, a.col_opts, where + " columnwise", size, n, *col_data, *col_scale,
                                  *col_amax, &a.col_data, &a.col_scale, &a.col_amax));
  const bool row_nv = row_kind == quantize::kNvfp4, col_nv = col_kind == quantize::kNvfp4;
  const bool nv = row_nv || col_nv;
  const bool row_given = row_nv && (amax_given & 1), col_given = col_nv && (amax_given & 2);
  const int64_t given_size = static_cast<int64_t>(ElementCount(amax_in));
  JF4_CHECK(given_size == 2 * n || (given_size == 0 && (amax_given & 3) == 0),
            where + ": amax_in must be float32[2N] (or float32[0] with amax_given 0), got " +
                std::to_string(given_size) + " elements with amax_given " + std::to_string(amax_given));
  JF4_CHECK(static_cast<int64_t>(ElementCount(*scratch)) == (nv ? 2 * n : 0) + 1,
            where + ": scratch must be float32[2N + 1] with an NVFP4 orientation, else float32[1]");
  JF4_CHECK(size == 0 || a.x != nullptr, where + ": null input buffer");
  JF4_CHECK(first_dims.typed_data() != nullptr && last_dims.typed_data() != nullptr, where + ": null dims");

  grouped::AmaxArgs am{};
  float* s = scratch->typed_data();
  a.work = reinterpret_cast<int32_t*>(s + (nv ? 2 * n : 0));
  if (nv) {  // given orientations read amax_in directly; the computed ones the scratch the amax kernel fills
    a.amax_row = row_given ? amax_in.typed_data() : s;
    a.amax_col = col_given ? amax_in.typed_data() + n : s + n;
    am.x = a.x, am.size = size, am.n = a.n;
    am.first_dims = a.first_dims, am.last_dims = a.last_dims;
    am.amax_bits = reinterpret_cast<uint32_t*>(s);
    am.row = row_nv && !row_given, am.col = col_nv && !col_given;
    am.row_rht = row_nv && (a.row_opts & quantize::kRht);
    am.col_rht = col_nv && (a.col_opts & quantize::kRht);
  }
  // The amax kernel max-reduces into zeroed scratch (all given: no amax launch); the counter starts at 0.
  if (am.row || am.col) {
    JF4_CUDA_CHECK(cudaMemsetAsync(s, 0, sizeof(float) * (2 * n + 1), stream));
  } else {
    JF4_CUDA_CHECK(cudaMemsetAsync(a.work, 0, sizeof(int32_t), stream));
  }
  const bool amax_pass = nv && size > 0 && (am.row || am.col);
  return DispatchFloat(x.element_type(), "jf4_grouped_quantize: x", [&](auto tag) -> ffi::Error {
    using Tag = decltype(tag);
    using In = std::conditional_t<Tag::kDataType == ffi::DataType::BF16, __nv_bfloat16,
                                  std::conditional_t<Tag::kDataType == ffi::DataType::F16, __half, float>>;
    return LaunchFor<In>(row_kind, col_kind, a, amax_pass, am, stream);
  });
}

}  // namespace
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(jf4_grouped_quantize, jax_fp4::GroupedQuantizeImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int32_t>("row_kind")
                                  .Attr<int32_t>("col_kind")
                                  .Attr<int32_t>("flags")
                                  .Attr<int32_t>("amax_given"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
