// Signatures and operand / result checks of the jf4_grouped_quantize and jf4_grouped_dequantize FFI handlers, shared
// by the host handlers (cpp/cpu/grouped_*_cpu.cc) and the CUDA ones (cpp/grouped/grouped_*_ffi.cu): host-only code,
// included by .cc and .cu files alike. Every size and dtype of a call is checked against its group count and buffer
// size, so a mismatched call is an InvalidArgument error naming the offending operand, never an out-of-bounds access.
// The one difference between the handlers is the group count: the CUDA kernels keep the group table in shared memory
// (at most grouped::kMaxGroups groups), the host handlers have no limit (kNoGroupLimit).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "common/errors.h"
#include "common/ffi_checks.h"
#include "common/ffi_codes.h"
#include "common/ffi_utils.h"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace checks {

// max_groups of a handler whose group table has no size limit.
constexpr int64_t kNoGroupLimit = 0;

// "<prefix> of <size> elements, <n> groups": the start of a grouped handler's messages.
inline std::string GroupedWhere(const char* prefix, int64_t size, int64_t n) {
  return std::string(prefix) + " of " + std::to_string(size) + " elements, " + std::to_string(n) + " groups";
}

// The buffer size (< 2**31 elements, `what` names it), the group count (1..max_groups, or at least 1 with
// kNoGroupLimit) and last_dims (N int32).
inline ffi::Error CheckGroups(const std::string& where, const char* what, int64_t size, int64_t n,
                              size_t last_dims_count, int64_t max_groups) {
  JF4_CHECK(size < (int64_t(1) << 31), where + ": " + what + " must have fewer than 2**31 elements");
  if (max_groups == kNoGroupLimit) {
    JF4_CHECK(n >= 1, where + ": at least one group");
  } else {
    JF4_CHECK(n >= 1 && n <= max_groups, where + ": the kernel takes 1.." + std::to_string(max_groups) + " groups");
  }
  JF4_CHECK(static_cast<int64_t>(last_dims_count) == n, where + ": last_dims must hold N int32");
  return ffi::Error::Success();
}

// `b` holds `count` elements of `dtype` and a buffer; count == 0: an empty placeholder of any dtype.
inline ffi::Error CheckGroupedBuffer(const ffi::AnyBuffer& b, ffi::DataType dtype, int64_t count,
                                     const std::string& what) {
  if (count == 0) {
    JF4_CHECK(ElementCount(b) == 0, what + ": expected an empty placeholder, got " + std::to_string(ElementCount(b)) +
                                        " elements");
    return ffi::Error::Success();
  }
  return CheckBuffer(b, dtype, count, what);
}

// ---- jf4_grouped_quantize ----------------------------------------------------------------------------------------

// The binding of a jf4_grouped_quantize handler after `b` (xla::ffi::Ffi::Bind(), the CUDA handler's with the platform
// stream bound first): operands x, first_dims s32, last_dims s32, key_row u32, key_col u32, amax_in f32, then any
// number of ignored ones; results row data, row scale, row amax, col data, col scale, col amax, scratch f32;
// attributes row_kind, col_kind, flags, amax_given.
template <typename Binding>
auto GroupedQuantizeSignature(Binding b) {
  using ffi::AnyBuffer, ffi::Buffer, ffi::F32, ffi::S32, ffi::U32;
  auto args = BindArgs<AnyBuffer, Buffer<S32>, Buffer<S32>, Buffer<U32>, Buffer<U32>, Buffer<F32>>(std::move(b))
                  .RemainingArgs();
  auto rets = BindRets<AnyBuffer, AnyBuffer, AnyBuffer, AnyBuffer, AnyBuffer, AnyBuffer, Buffer<F32>>(std::move(args));
  return BindAttrs<int32_t>(std::move(rets), "row_kind", "col_kind", "flags", "amax_given");
}

// One orientation of a checked call: its format, NVFP4 options and result pointers (null where absent; amax null
// for MXFP8).
struct GroupedResults {
  int kind = codes::kNone, opts = 0;
  uint8_t* data = nullptr;
  uint8_t* scale = nullptr;
  float* amax = nullptr;
};

// Validates one orientation (`side` prefixes the messages) of a call on `size` elements in `n` groups: kNone takes
// empty placeholders; otherwise a known format, options NVFP4 SR / RHT only, data [size] codes, scale [size / block]
// and amax f32[N] (NVFP4) or an empty placeholder (MXFP8).
inline ffi::Error CheckGroupedOrientation(int kind, int opts, const std::string& side, int64_t size, int64_t n,
                                          const ffi::AnyBuffer& data, const ffi::AnyBuffer& scale,
                                          const ffi::AnyBuffer& amax, GroupedResults* out) {
  out->kind = kind, out->opts = opts;
  if (kind == codes::kNone) {
    JF4_RETURN_IF_ERROR(CheckGroupedBuffer(data, ffi::DataType::U8, 0, side + " data"));
    JF4_RETURN_IF_ERROR(CheckGroupedBuffer(scale, ffi::DataType::U8, 0, side + " scale"));
    return CheckGroupedBuffer(amax, ffi::DataType::F32, 0, side + " amax");
  }
  JF4_CHECK(kind == codes::kNvfp4 || kind == codes::kMxfp8E4m3 || kind == codes::kMxfp8E5m2,
            side + ": unknown format kind " + std::to_string(kind));
  const bool nvfp4 = kind == codes::kNvfp4;
  constexpr int kGroupedOptions = codes::quantize::kSr | codes::quantize::kRht | codes::quantize::kUse4over6 |
                                  codes::quantize::kE4m3Max256 | codes::quantize::kErrMse;
  JF4_CHECK((opts & ~kGroupedOptions) == 0 && (nvfp4 || opts == 0),
            side + ": unsupported options " + std::to_string(opts) + " (grouped: NVFP4 1D with SR / RHT / 4over6, "
                   "MXFP8)");
  JF4_CHECK(!((opts & codes::quantize::kUse4over6) && (opts & (codes::quantize::kSr | codes::quantize::kRht))),
            side + ": 4over6 excludes stochastic rounding and RHT");
  JF4_RETURN_IF_ERROR(CheckGroupedBuffer(data, CodeType(kind), size, side + " data"));
  JF4_RETURN_IF_ERROR(CheckGroupedBuffer(scale, ScaleType(kind), size / BlockSize(kind), side + " scale"));
  JF4_RETURN_IF_ERROR(CheckGroupedBuffer(amax, ffi::DataType::F32, nvfp4 ? n : 0, side + " amax"));
  out->data = static_cast<uint8_t*>(data.untyped_data());
  out->scale = static_cast<uint8_t*>(scale.untyped_data());
  out->amax = nvfp4 ? static_cast<float*>(amax.untyped_data()) : nullptr;
  return ffi::Error::Success();
}

// A checked jf4_grouped_quantize call.
struct GroupedQuantizeCall {
  int64_t size = 0, n = 0;
  GroupedResults row, col;
};

// Validates a call (x's dtype is the handler's to dispatch): x's size, the group count (see CheckGroups), the keys
// uint32[N, 2], the format pairing (QuantizePairSupported), both orientations (flags: row options | col options <<
// kColShift), amax_in f32[2N] (or f32[0] when amax_given is 0), scratch f32[2N + 1] with an NVFP4 orientation (else
// f32[1]), and the input and dims buffers.
inline ffi::Error CheckGroupedQuantize(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& first_dims,
                                       const ffi::Buffer<ffi::S32>& last_dims, const ffi::Buffer<ffi::U32>& key_row,
                                       const ffi::Buffer<ffi::U32>& key_col, const ffi::Buffer<ffi::F32>& amax_in,
                                       const ffi::AnyBuffer& row_data, const ffi::AnyBuffer& row_scale,
                                       const ffi::AnyBuffer& row_amax, const ffi::AnyBuffer& col_data,
                                       const ffi::AnyBuffer& col_scale, const ffi::AnyBuffer& col_amax,
                                       const ffi::Buffer<ffi::F32>& scratch, int row_kind, int col_kind, int flags,
                                       int amax_given, int64_t max_groups, GroupedQuantizeCall* c) {
  const int64_t size = static_cast<int64_t>(ElementCount(x));
  const int64_t n = static_cast<int64_t>(ElementCount(first_dims));
  const std::string where = GroupedWhere("jf4_grouped_quantize: x", size, n);
  JF4_RETURN_IF_ERROR(CheckGroups(where, "x", size, n, ElementCount(last_dims), max_groups));
  const int64_t kr = static_cast<int64_t>(ElementCount(key_row)), kc = static_cast<int64_t>(ElementCount(key_col));
  JF4_CHECK(kr == 2 * n && kc == 2 * n, where + ": keys must be uint32[N, 2]");
  JF4_CHECK(QuantizePairSupported(row_kind, col_kind), where + ": unsupported format pairing row_kind " +
                                                           std::to_string(row_kind) + ", col_kind " +
                                                           std::to_string(col_kind));
  const int row_opts = flags & codes::quantize::kOptionMask;
  const int col_opts = (flags >> codes::quantize::kColShift) & codes::quantize::kOptionMask;
  JF4_RETURN_IF_ERROR(
      CheckGroupedOrientation(row_kind, row_opts, where + " rowwise", size, n, row_data, row_scale, row_amax, &c->row));
  JF4_RETURN_IF_ERROR(
      CheckGroupedOrientation(col_kind, col_opts, where + " columnwise", size, n, col_data, col_scale, col_amax,
                              &c->col));
  const bool nv = row_kind == codes::kNvfp4 || col_kind == codes::kNvfp4;
  const int64_t given_size = static_cast<int64_t>(ElementCount(amax_in));
  JF4_CHECK(given_size == 2 * n || (given_size == 0 && (amax_given & 3) == 0),
            where + ": amax_in must be float32[2N] (or float32[0] with amax_given 0), got " +
                std::to_string(given_size) + " elements with amax_given " + std::to_string(amax_given));
  JF4_CHECK(static_cast<int64_t>(ElementCount(scratch)) == (nv ? 2 * n : 0) + 1,
            where + ": scratch must be float32[2N + 1] with an NVFP4 orientation, else float32[1]");
  JF4_CHECK(size == 0 || x.untyped_data() != nullptr, where + ": null input buffer");
  JF4_CHECK(first_dims.typed_data() != nullptr && last_dims.typed_data() != nullptr, where + ": null dims");
  c->size = size, c->n = n;
  return ffi::Error::Success();
}

// ---- jf4_grouped_dequantize --------------------------------------------------------------------------------------

// The binding of a jf4_grouped_dequantize handler after `b` (as GroupedQuantizeSignature): operands data, scale,
// amax f32, first_dims s32, last_dims s32, then any number of ignored ones; result out; attributes kind, flags.
template <typename Binding>
auto GroupedDequantizeSignature(Binding b) {
  using ffi::AnyBuffer, ffi::Buffer, ffi::F32, ffi::S32;
  auto args = BindArgs<AnyBuffer, AnyBuffer, Buffer<F32>, Buffer<S32>, Buffer<S32>>(std::move(b)).RemainingArgs();
  return BindAttrs<int32_t>(BindRets<AnyBuffer>(std::move(args)), "kind", "flags");
}

// A checked jf4_grouped_dequantize call.
struct GroupedDequantizeCall {
  int64_t size = 0, n = 0, bs = 16;
  bool nvfp4 = false;
  bool col = false, rht = false, raw = false;  // the flags (kColumnwise, kRht for NVFP4, kRaw)
  bool bound256 = false;                       // kE4m3Max256: NVFP4 tensor scales amax * fp32(1/1536)
  bool tensor_scale = false;                   // NVFP4 not raw: amax holds the per-group tensor amaxes
  ffi::DataType out_type = ffi::DataType::F32;
  std::string where;  // "jf4_grouped_dequantize: data of <size> elements, <n> groups", the messages' prefix
};

// Validates a call: the kind and flags, data [size] of the kind's code dtype, the group count (see CheckGroups),
// scale [size / block] of the kind's scale dtype, amax f32[N] (NVFP4 not raw) or f32[0], the output (size elements
// of float32, bfloat16 or float16) and, for a non-empty call, the data, scale and output buffers.
inline ffi::Error CheckGroupedDequantize(const ffi::AnyBuffer& data, const ffi::AnyBuffer& scale,
                                         const ffi::Buffer<ffi::F32>& amax, const ffi::Buffer<ffi::S32>& first_dims,
                                         const ffi::Buffer<ffi::S32>& last_dims, const ffi::AnyBuffer& out, int kind,
                                         int flags, int64_t max_groups, GroupedDequantizeCall* c) {
  constexpr int kColumnwise = codes::grouped_dequantize::kColumnwise, kRht = codes::grouped_dequantize::kRht,
                kRaw = codes::grouped_dequantize::kRaw;
  const int64_t size = static_cast<int64_t>(ElementCount(data));
  const int64_t n = static_cast<int64_t>(ElementCount(first_dims));
  const std::string where = GroupedWhere("jf4_grouped_dequantize: data", size, n);
  const bool nvfp4 = kind == codes::kNvfp4;
  JF4_CHECK(nvfp4 || kind == codes::kMxfp8E4m3 || kind == codes::kMxfp8E5m2,
            where + ": unknown kind " + std::to_string(kind));
  JF4_CHECK((flags & ~(kColumnwise | kRht | kRaw | codes::grouped_dequantize::kE4m3Max256)) == 0 &&
                (nvfp4 || (flags & (kRht | kRaw | codes::grouped_dequantize::kE4m3Max256)) == 0),
            where + ": unsupported flags " + std::to_string(flags));
  const ffi::DataType dtype = CodeType(kind);
  JF4_CHECK(size == 0 || data.element_type() == dtype, where + ": data dtype " + DataTypeName(data.element_type()));
  JF4_RETURN_IF_ERROR(CheckGroups(where, "data", size, n, ElementCount(last_dims), max_groups));
  const int64_t bs = BlockSize(kind);
  JF4_CHECK(static_cast<int64_t>(ElementCount(scale)) == size / bs,
            where + ": scale must hold size / " + std::to_string(bs) + " elements, got " +
                std::to_string(ElementCount(scale)));
  JF4_CHECK(size / bs == 0 || scale.element_type() == (nvfp4 ? ffi::DataType::F8E4M3FN : ffi::DataType::F8E8M0FNU),
            where + ": scale dtype " + DataTypeName(scale.element_type()));
  const bool raw = flags & kRaw;
  const bool tensor_scale = nvfp4 && !raw;
  JF4_CHECK(static_cast<int64_t>(ElementCount(amax)) == (tensor_scale ? n : 0),
            where + ": amax must be float32[N] for NVFP4 (not raw), else float32[0]");
  JF4_CHECK(static_cast<int64_t>(ElementCount(out)) == size, where + ": the output must hold size elements");
  const ffi::DataType od = out.element_type();
  JF4_CHECK(od == ffi::DataType::F32 || od == ffi::DataType::BF16 || od == ffi::DataType::F16,
            where + ": output dtype " + DataTypeName(od) + " (expected float32, bfloat16 or float16)");
  JF4_CHECK(size == 0 || (data.untyped_data() != nullptr && out.untyped_data() != nullptr &&
                          (size < bs || scale.untyped_data() != nullptr)),
            where + ": null buffer");
  c->size = size, c->n = n, c->bs = bs;
  c->nvfp4 = nvfp4, c->col = flags & kColumnwise, c->rht = nvfp4 && (flags & kRht), c->raw = raw;
  c->bound256 = nvfp4 && (flags & codes::grouped_dequantize::kE4m3Max256);
  c->tensor_scale = tensor_scale;
  c->out_type = od;
  c->where = where;
  return ffi::Error::Success();
}

}  // namespace checks
}  // namespace jax_fp4
