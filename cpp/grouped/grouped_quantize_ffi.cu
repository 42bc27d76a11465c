// FFI handler `jf4_grouped_quantize`: rowwise and/or columnwise NVFP4 / MXFP8 quantization of N groups held in one
// buffer (grouped_quantize.cuh), group sizes read on the device only.
//
// Operands: x (bf16/f16/f32, any shape, read flat: group g is [M_g, K_g] row-major at offsets[g]), first_dims and
// last_dims int32[N] (M_g, K_g), key_row and key_col uint32[N, 2] (per-group Philox key words of stochastic rounding),
// amax_in f32[2N] or [0] (given per-group NVFP4 tensor amaxes, row then column), then any number of ignored operands
// (tests alias poisoned buffers to the results through them). Results (7; placeholders of 0 elements where an
// orientation is absent): row_data [size], row_scale [size / block], row_amax f32[N] (NVFP4, else [0]), col_data,
// col_scale, col_amax, and scratch f32[2N + 1] (the computed per-group amaxes, row then column, then the quantize
// kernel's scheduling counter as int32 bits; f32[1] without NVFP4). Attributes: row_kind, col_kind (quantize::Kind),
// flags (row options | col options << 8; NVFP4 kSr / kRht only), amax_given (bit 0: the rowwise, bit 1: the columnwise
// NVFP4 amaxes come from amax_in, which must then be f32[2N], and the quantize kernel reads them there; the others are
// computed). Every size is checked (common/ffi_grouped_checks.h), so a mismatched call is an InvalidArgument error.
// Command-buffer compatible: a cudaMemsetAsync of the scratch (with NVFP4 amaxes to compute) or of its counter word,
// the per-group amax kernel where amaxes are computed, then the quantize kernel; no host sync, no allocation.
//
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "common/errors.h"
#include "common/ffi_codes.h"
#include "common/ffi_grouped_checks.h"
#include "common/ffi_utils.h"
#include "grouped/group_table.cuh"
#include "grouped/grouped_amax.cuh"
#include "grouped/grouped_quantize.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace {

using grouped::QuantArgs;

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
  checks::GroupedQuantizeCall c;
  JF4_RETURN_IF_ERROR(checks::CheckGroupedQuantize(x, first_dims, last_dims, key_row, key_col, amax_in, *row_data,
                                                   *row_scale, *row_amax, *col_data, *col_scale, *col_amax, *scratch,
                                                   row_kind, col_kind, flags, amax_given, grouped::kMaxGroups, &c));
  const int64_t size = c.size, n = c.n;
  QuantArgs a{};
  a.x = x.untyped_data();
  a.size = size;
  a.n = static_cast<int>(n);
  a.first_dims = first_dims.typed_data();
  a.last_dims = last_dims.typed_data();
  a.key_row = key_row.typed_data();
  a.key_col = key_col.typed_data();
  a.row_opts = c.row.opts, a.col_opts = c.col.opts;
  a.row_data = c.row.data, a.row_scale = c.row.scale, a.row_amax = c.row.amax;
  a.col_data = c.col.data, a.col_scale = c.col.scale, a.col_amax = c.col.amax;
  const bool row_nv = row_kind == quantize::kNvfp4, col_nv = col_kind == quantize::kNvfp4;
  const bool nv = row_nv || col_nv;
  const bool row_given = row_nv && (amax_given & 1), col_given = col_nv && (amax_given & 2);

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
                              jax_fp4::checks::GroupedQuantizeSignature(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
