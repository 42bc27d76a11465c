// FFI handlers `jf4_swizzle` and `jf4_unswizzle`: compact <-> GEMM-swizzled block-scale matrices.
//
// jf4_swizzle:   in  8-bit [..., rows, cols]                                  -> out [..., Rp, Cp]
// jf4_unswizzle: in  8-bit [..., Rp, Cp] (Rp % 128 == 0, Cp % 4 == 0)          -> out [..., rows, cols]
// with Rp = round_up(rows, 128), Cp = round_up(cols, 4); leading dimensions are independent matrices. In and out
// have the same 8-bit dtype (uint8, int8, float8_e4m3fn, float8_e5m2, float8_e8m0fnu). The swizzle kernel writes the
// padding as zero bytes. Extra operands (RemainingArgs) are accepted and ignored, so a test can alias a poisoned
// buffer to the output. Every size is checked, so a mismatched call is an InvalidArgument error, never an
// out-of-bounds access; an empty matrix launches nothing. Command-buffer compatible: one launch, no host sync.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/errors.h"
#include "common/ffi_utils.h"
#include "swizzle/swizzle.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace {

bool ByteType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::U8:
    case ffi::DataType::S8:
    case ffi::DataType::F8E4M3FN:
    case ffi::DataType::F8E5M2:
    case ffi::DataType::F8E8M0FNU:
      return true;
    default:
      return false;
  }
}

std::string Shape(const ffi::AnyBuffer::Dimensions& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Shared validation: `compact` [..., rows, cols] and `swizzled` [..., Rp, Cp] agree; fills batch/rows/cols.
ffi::Error Check(const char* name, const ffi::AnyBuffer& in, const ffi::AnyBuffer& out, const ffi::AnyBuffer& compact,
                 const ffi::AnyBuffer& swizzled, int64_t& batch, int64_t& rows, int64_t& cols) {
  const auto cd = compact.dimensions(), sd = swizzled.dimensions();
  const std::string where = std::string(name) + ": in " + DataTypeName(in.element_type()) + Shape(in.dimensions()) +
                            ", out " + DataTypeName(out.element_type()) + Shape(out.dimensions());
  JF4_CHECK(cd.size() >= 2 && cd.size() == sd.size(), where + ": expected equal ranks >= 2");
  JF4_CHECK(in.element_type() == out.element_type() && ByteType(in.element_type()),
            where + ": expected one 8-bit dtype (uint8, int8, float8_e4m3fn, float8_e5m2, float8_e8m0fnu)");
  batch = 1;
  for (size_t i = 0; i + 2 < cd.size(); ++i) {
    JF4_CHECK(cd[i] == sd[i], where + ": leading (batch) dimensions differ");
    batch *= cd[i];
  }
  rows = cd[cd.size() - 2];
  cols = cd[cd.size() - 1];
  const swizzle::Geometry g = swizzle::MakeGeometry(rows, cols, nullptr);
  JF4_CHECK(sd[sd.size() - 2] == g.rows_padded && sd[sd.size() - 1] == g.cols_padded,
            where + ": the swizzled matrix must be [round_up(rows, 128), round_up(cols, 4)] = [" +
                std::to_string(g.rows_padded) + ", " + std::to_string(g.cols_padded) + "]");
  JF4_CHECK(swizzle::NumBlocks(batch, g) < (int64_t(1) << 31), where + ": exceeds the kernel's grid");
  return ffi::Error::Success();
}

// jf4_swizzle (kSwizzle: compact `in` -> swizzled `out`) and jf4_unswizzle (swizzled `in` -> compact `out`).
template <bool kSwizzle>
ffi::Error LayoutImpl(cudaStream_t stream, ffi::AnyBuffer in, ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> out) {
  const ffi::AnyBuffer& compact = kSwizzle ? in : *out;
  const ffi::AnyBuffer& swizzled = kSwizzle ? *out : in;
  const char* name = kSwizzle ? "jf4_swizzle" : "jf4_unswizzle";
  int64_t batch = 0, rows = 0, cols = 0;
  JF4_RETURN_IF_ERROR(Check(name, in, *out, compact, swizzled, batch, rows, cols));
  const auto* src = static_cast<const uint8_t*>(in.untyped_data());
  auto* dst = static_cast<uint8_t*>(out->untyped_data());
  const swizzle::Geometry g = swizzle::MakeGeometry(rows, cols, compact.untyped_data());
  const auto launch = kSwizzle ? swizzle::LaunchSwizzle : swizzle::LaunchUnswizzle;
  JF4_CUDA_CHECK(launch(src, dst, batch, g, stream));
  return ffi::Error::Success();
}

// Both handlers' signature: (stream, in, ignored extra operands...) -> out.
auto LayoutBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()
      .RemainingArgs()
      .Ret<ffi::AnyBuffer>();
}

}  // namespace
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(jf4_swizzle, jax_fp4::LayoutImpl<true>, jax_fp4::LayoutBinding(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(jf4_unswizzle, jax_fp4::LayoutImpl<false>, jax_fp4::LayoutBinding(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
