// Signatures and operand / result checks of the jf4_quantize and jf4_dequantize FFI handlers, shared by the host
// handlers (cpp/cpu/) and the CUDA ones (cpp/quantize/quantize_ffi.cu, cpp/dequantize/dequantize_ffi.cu): host-only
// code, included by .cc and .cu files alike. Every shape and dtype of a call is checked against the geometry its
// attributes give, so a mismatched call is an InvalidArgument error naming the offending operand, never an
// out-of-bounds access.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "common/errors.h"
#include "common/ffi_codes.h"
#include "common/ffi_utils.h"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace checks {

// Words of a shard's stochastic-rounding stream (quantize.py SHARD_KEY_WORDS): k0, k1, 3 offsets, 3 global dims.
constexpr size_t kShardKeyWords = 8;

inline int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

inline std::string Shape(int64_t a, int64_t b, int64_t c) {
  return "[" + std::to_string(a) + ", " + std::to_string(b) + ", " + std::to_string(c) + "]";
}

inline int BlockSize(int kind) { return kind == codes::kNvfp4 ? 16 : 32; }

// dtype of a format's codes and of its block scales.
inline ffi::DataType CodeType(int kind) {
  switch (kind) {
    case codes::kNvfp4: return ffi::DataType::F4E2M1FN;
    case codes::kMxfp8E4m3: return ffi::DataType::F8E4M3FN;
    default: return ffi::DataType::F8E5M2;
  }
}
inline ffi::DataType ScaleType(int kind) {
  return kind == codes::kNvfp4 ? ffi::DataType::F8E4M3FN : ffi::DataType::F8E8M0FNU;
}

// `b` holds `count` elements of `dtype` (and a buffer unless empty).
inline ffi::Error CheckBuffer(const ffi::AnyBuffer& b, ffi::DataType dtype, int64_t count, const std::string& what) {
  JF4_CHECK(b.element_type() == dtype, what + ": expected " + DataTypeName(dtype) + ", got " +
                                           DataTypeName(b.element_type()));
  JF4_CHECK(static_cast<int64_t>(ElementCount(b)) == count,
            what + ": expected " + std::to_string(count) + " elements, got " + std::to_string(ElementCount(b)));
  JF4_CHECK(count == 0 || b.untyped_data() != nullptr, what + ": null buffer");
  return ffi::Error::Success();
}

// ---- jf4_quantize ------------------------------------------------------------------------------------------------

// The binding of a jf4_quantize handler after `b` (xla::ffi::Ffi::Bind(), the CUDA handler's with the platform stream
// bound first): operands x, amax_row f32, amax_col f32, key_row u32, key_col u32, then any number of ignored ones;
// results row data, row scale, row window amax, col data, col scale, col window amax, dbias; attributes row_kind,
// col_kind, flags (common/ffi_codes.h).
template <typename Binding>
auto QuantizeSignature(Binding b) {
  using ffi::AnyBuffer, ffi::Buffer, ffi::F32, ffi::U32;
  auto args = BindArgs<AnyBuffer, Buffer<F32>, Buffer<F32>, Buffer<U32>, Buffer<U32>>(std::move(b)).RemainingArgs();
  auto rets = BindRets<AnyBuffer, AnyBuffer, AnyBuffer, AnyBuffer, AnyBuffer, AnyBuffer, AnyBuffer>(std::move(args));
  return BindAttrs<int32_t>(std::move(rets), "row_kind", "col_kind", "flags");
}

// Format pairings one call computes (the Python lowering splits any other pairing into two calls): NVFP4 rowwise with
// any columnwise format, MXFP8 rowwise with the same MXFP8 columnwise, or one orientation alone.
inline bool QuantizePairSupported(int row_kind, int col_kind) {
  if (row_kind == codes::kNone || col_kind == codes::kNone) return row_kind != col_kind;
  if (row_kind == codes::kNvfp4) return true;
  return row_kind == col_kind;
}

// The operands of a call before its results: x rank 3 [P, M, K] (its dtype is the handler's to dispatch), the
// pairing, amax_row / amax_col f32[P], keys uint32[2] (Philox key) or uint32[8] (a shard's stream words), and a
// dbias request only with a columnwise output. Sets P, M, K.
inline ffi::Error CheckQuantizeOperands(const ffi::AnyBuffer& x, size_t amax_row_count, size_t amax_col_count,
                                        size_t key_row_words, size_t key_col_words, int row_kind, int col_kind,
                                        int flags, int64_t* P, int64_t* M, int64_t* K) {
  const auto dims = x.dimensions();
  JF4_CHECK(dims.size() == 3, "jf4_quantize: x must be rank 3 [P, M, K], got rank " + std::to_string(dims.size()));
  *P = dims[0], *M = dims[1], *K = dims[2];
  JF4_CHECK(QuantizePairSupported(row_kind, col_kind), "jf4_quantize: unsupported format pairing row_kind " +
                                                           std::to_string(row_kind) + ", col_kind " +
                                                           std::to_string(col_kind));
  JF4_CHECK(static_cast<int64_t>(amax_row_count) == *P && static_cast<int64_t>(amax_col_count) == *P,
            "jf4_quantize: amax operands must hold P = " + std::to_string(*P) + " floats");
  const auto key_ok = [](size_t n) { return n == 2 || n == kShardKeyWords; };
  JF4_CHECK(key_ok(key_row_words) && key_ok(key_col_words),
            "jf4_quantize: keys must be uint32[2] (Philox key) or uint32[8] (a shard's stream words), got " +
                std::to_string(key_row_words) + " and " + std::to_string(key_col_words) + " words");
  JF4_CHECK(!(flags & codes::quantize::kDbias) || col_kind != codes::kNone,
            "jf4_quantize: dbias needs a columnwise output");
  return ffi::Error::Success();
}

// One orientation's three results, checked (CheckQuantizeOrientation).
struct QuantizeResults {
  uint8_t* data = nullptr;   // codes (NVFP4 packed, even index low nibble) or, when exact, bfloat16 values
  uint8_t* scale = nullptr;  // compact [rows, cols] or swizzled [round_up(rows, 128), cols_padded]
  float* wamax = nullptr;    // NVFP4 1x64 window amaxes, else null
  int64_t cols_padded = 0;   // swizzled: round_up(cols, 4)
  int64_t scale_count = 0;   // elements of the scale result
  bool padded = false;       // swizzled with padding bytes (zeros the handler writes)
};

// Validates one orientation (`col`: columnwise, blocks along M) of format `kind` with NVFP4 options `opts`: the block
// axis, the 1x64 / 2D tile constraints, no exact operand for 1x64, and the data (codes, or bfloat16 when `exact`),
// scale and window-amax results' dtypes and sizes. kind == kNone: no results (and no exact request).
inline ffi::Error CheckQuantizeOrientation(int kind, int opts, bool col, bool exact, bool swizzled, int64_t P,
                                           int64_t M, int64_t K, const ffi::AnyBuffer& data,
                                           const ffi::AnyBuffer& scale, const ffi::AnyBuffer& wamax,
                                           QuantizeResults* out) {
  const std::string side = col ? "columnwise" : "rowwise";
  if (kind == codes::kNone) {
    JF4_CHECK(!exact, side + ": exact operand requested without a format");
    return ffi::Error::Success();
  }
  JF4_CHECK(kind == codes::kNvfp4 || kind == codes::kMxfp8E4m3 || kind == codes::kMxfp8E5m2,
            side + ": unknown format kind " + std::to_string(kind));
  const int64_t bs = BlockSize(kind);
  const int64_t blocked = col ? M : K;
  JF4_CHECK(blocked % bs == 0, side + ": block axis of x " + Shape(P, M, K) + " is not a multiple of " +
                                   std::to_string(bs));
  const bool nvfp4 = kind == codes::kNvfp4;
  const bool local = nvfp4 && (opts & codes::quantize::kLocal1x64);
  if (local) JF4_CHECK(blocked % 64 == 0, side + ": 1x64 needs the block axis % 64 == 0, x " + Shape(P, M, K));
  if (nvfp4 && (opts & codes::quantize::kScaling2d)) {
    JF4_CHECK((col ? K : M) % 16 == 0, side + ": 2D scaling needs 16x16 tiles inside each x[p], x " + Shape(P, M, K));
  }
  JF4_CHECK(!(exact && local), side + ": no exact operand for 1x64 (its window scales do not factor out)");
  JF4_CHECK(!(nvfp4 && (opts & codes::quantize::kUse4over6) &&
              (opts & (codes::quantize::kSr | codes::quantize::kRht | codes::quantize::kLocal1x64))),
            side + ": 4over6 excludes stochastic rounding, RHT and 1x64");
  JF4_RETURN_IF_ERROR(CheckBuffer(data, exact ? ffi::DataType::BF16 : CodeType(kind), P * M * K, side + " data"));
  const int64_t rows = P * (col ? K : M);  // scale-matrix rows (MXFP8 columnwise viewed transposed)
  const int64_t cols = blocked / bs;
  int64_t scale_count = rows * cols;
  if (swizzled) {
    out->cols_padded = RoundUp(cols, 4);
    scale_count = RoundUp(rows, 128) * out->cols_padded;
  }
  out->scale_count = scale_count;
  out->padded = scale_count != rows * cols;
  JF4_RETURN_IF_ERROR(CheckBuffer(scale, ScaleType(kind), scale_count, side + " scale"));
  JF4_RETURN_IF_ERROR(CheckBuffer(wamax, ffi::DataType::F32, local ? rows * (blocked / 64) : 0, side + " window amax"));
  out->data = static_cast<uint8_t*>(data.untyped_data());
  out->scale = static_cast<uint8_t*>(scale.untyped_data());
  out->wamax = local ? static_cast<float*>(wamax.untyped_data()) : nullptr;
  return ffi::Error::Success();
}

// The dbias result: f32 [P, ceil(M / 64), K] partial sums when requested, else empty.
inline ffi::Error CheckDbias(const ffi::AnyBuffer& dbias, int flags, int64_t P, int64_t M, int64_t K) {
  const bool with_dbias = flags & codes::quantize::kDbias;
  return CheckBuffer(dbias, ffi::DataType::F32, with_dbias ? P * ((M + 63) / 64) * K : 0, "dbias");
}

// ---- jf4_dequantize ----------------------------------------------------------------------------------------------

// The binding of a jf4_dequantize handler after `b` (as QuantizeSignature): operands data, scale, amax f32, window
// amax f32, then any number of ignored ones; result out; attributes kind, flags.
template <typename Binding>
auto DequantizeSignature(Binding b) {
  using ffi::AnyBuffer, ffi::Buffer, ffi::F32;
  auto args = BindArgs<AnyBuffer, AnyBuffer, Buffer<F32>, Buffer<F32>>(std::move(b)).RemainingArgs();
  return BindAttrs<int32_t>(BindRets<AnyBuffer>(std::move(args)), "kind", "flags");
}

// The geometry of a checked jf4_dequantize call.
struct DequantizeGeometry {
  int64_t P = 0, R = 0, C = 0;
  bool nvfp4 = false, local = false, swizzled = false;
  bool col = false;           // MXFP8 with blocks along R (kMxColumnwise)
  bool transpose = false;     // NVFP4 output [P, C, R] (kTransposeOut)
  bool block_only = false;    // NVFP4 1D/2D without an amax operand: value * block scale
  bool tensor_scale = false;  // NVFP4 with its tensor amax (1 or P floats)
  bool amax_per_p = false;    // one amax per p (P > 1 floats)
  int64_t cols_padded = 0;    // round_up(scale columns, 4)
  std::string where;          // "jf4_dequantize: data [P, R, C]", the prefix of the handler's own messages
};

// Validates a call: data rank 3 [P, R, C] of the kind's code dtype, the block axis, the flags, the scale dtype and
// size (compact or swizzled), the amax / window-amax operands, and the output's shape and dtype (float32, bfloat16
// or float16).
inline ffi::Error CheckDequantize(const ffi::AnyBuffer& data, const ffi::AnyBuffer& scale, size_t amax_count,
                                  size_t window_amax_count, const ffi::AnyBuffer& out, int kind, int flags,
                                  DequantizeGeometry* g) {
  const auto dims = data.dimensions();
  JF4_CHECK(dims.size() == 3, "jf4_dequantize: data must be rank 3 [P, R, C], got rank " +
                                  std::to_string(dims.size()));
  const int64_t P = dims[0], R = dims[1], C = dims[2];
  const std::string where = "jf4_dequantize: data " + Shape(P, R, C);
  const bool nvfp4 = kind == codes::kNvfp4;
  JF4_CHECK(nvfp4 || kind == codes::kMxfp8E4m3 || kind == codes::kMxfp8E5m2,
            where + ": unknown kind " + std::to_string(kind));
  JF4_CHECK(data.element_type() == CodeType(kind), where + ": data dtype " + DataTypeName(data.element_type()));
  const bool col = !nvfp4 && (flags & codes::dequantize::kMxColumnwise);
  const bool local = nvfp4 && (flags & codes::dequantize::kLocal1x64);
  const bool transpose = flags & codes::dequantize::kTransposeOut;
  JF4_CHECK(!transpose || nvfp4, where + ": only NVFP4 output is transposed");
  JF4_CHECK(!(flags & codes::dequantize::kMxColumnwise) || !nvfp4, where + ": kMxColumnwise is for MXFP8");
  const int64_t bs = BlockSize(kind);
  JF4_CHECK((col ? R % bs == 0 : C % bs == 0) && (!local || C % 64 == 0),
            where + ": the block axis is not a whole number of blocks (1x64: windows)");
  const int64_t rows = col ? P * C : P * R, cols = col ? R / bs : C / bs;
  const bool swizzled = flags & codes::dequantize::kSwizzled;
  const int64_t scale_count = swizzled ? RoundUp(rows, 128) * RoundUp(cols, 4) : rows * cols;
  JF4_CHECK(scale.element_type() == ScaleType(kind), where + ": scale dtype " + DataTypeName(scale.element_type()));
  JF4_CHECK(static_cast<int64_t>(ElementCount(scale)) == scale_count,
            where + ": scale holds " + std::to_string(ElementCount(scale)) + " elements, expected " +
                std::to_string(scale_count));
  const int64_t n_amax = static_cast<int64_t>(amax_count);
  const bool block_only = nvfp4 && !local && n_amax == 0;
  const bool tensor_scale = nvfp4 && !local && !block_only;
  JF4_CHECK(!tensor_scale || n_amax == 1 || n_amax == P,
            where + ": NVFP4 takes its tensor amax as 1 or P floats (or none: block scales only), got " +
                std::to_string(n_amax));
  JF4_CHECK(!(flags & codes::dequantize::kBlockOnly), where + ": kBlockOnly is set from an empty amax, not passed");
  JF4_CHECK(!local || static_cast<int64_t>(window_amax_count) == P * R * (C / 64),
            where + ": 1x64 window amax must hold P*R*C/64 floats");
  const auto od = out.dimensions();
  JF4_CHECK(od.size() == 3 && od[0] == P && od[1] == (transpose ? C : R) && od[2] == (transpose ? R : C),
            where + ": output shape mismatch");
  const auto ot = out.element_type();
  JF4_CHECK(ot == ffi::DataType::F32 || ot == ffi::DataType::BF16 || ot == ffi::DataType::F16,
            where + ": output dtype " + DataTypeName(ot) + " (expected float32, bfloat16 or float16)");
  g->P = P, g->R = R, g->C = C;
  g->nvfp4 = nvfp4, g->local = local, g->swizzled = swizzled, g->col = col, g->transpose = transpose;
  g->block_only = block_only, g->tensor_scale = tensor_scale, g->amax_per_p = tensor_scale && n_amax == P && P > 1;
  g->cols_padded = RoundUp(cols, 4);
  g->where = where;
  return ffi::Error::Success();
}

}  // namespace checks
}  // namespace jax_fp4
