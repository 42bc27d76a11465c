// The FFI attribute codes the primitives pass to the kernels: format kinds and flag bits. Defined once here for C++
// and once in jax_fp4/_src/ffi_codes.py for Python; tests/test_ffi_codes.py parses this header and checks that the
// two agree.
#pragma once

namespace jax_fp4 {
namespace codes {

// Format of an operand (the row_kind / col_kind / kind attributes).
enum Kind : int { kNone = 0, kNvfp4 = 1, kMxfp8E4m3 = 2, kMxfp8E5m2 = 3 };

// jf4_quantize / jf4_grouped_quantize: flags = row options | col options << kColShift | Flag bits.
namespace quantize {
// NVFP4 options of one orientation; kUse4over6: 4over6 block selection, kE4m3Max256: the tensor scale on the E4M3
// bound 256, kErrMse: 4over6 squared-error candidates.
enum Option : int {
  kSr = 1, kRht = 2, kScaling2d = 4, kLocal1x64 = 8, kUse4over6 = 16, kE4m3Max256 = 32, kErrMse = 64
};
constexpr int kColShift = 8;
constexpr int kOptionMask = 0xFF;
enum Flag : int { kSwizzled = 1 << 16, kDbias = 1 << 17, kRowExact = 1 << 18, kColExact = 1 << 19 };
}  // namespace quantize

// jf4_dequantize flags. kBlockOnly is set by the handler from an empty amax operand (never passed): values * block
// scale only, the exact GEMM-emulation operand.
namespace dequantize {
enum Flag : int {
  kRht = 2, kLocal1x64 = 8, kE4m3Max256 = 32, kSwizzled = 1 << 16, kTransposeOut = 1 << 17, kMxColumnwise = 1 << 18, kBlockOnly = 1 << 19
};
}  // namespace dequantize

// jf4_grouped_dequantize flags.
namespace grouped_dequantize {
enum Flag : int { kColumnwise = 1, kRht = 2, kRaw = 4, kE4m3Max256 = 32 };
}  // namespace grouped_dequantize

// jf4_gemm flags: which operands carry NVFP4 1x64 window scales (1x64 pairs only with 1x64), and whether the
// epilogue writes max |out| to the out_amax result.
namespace gemm {
enum Flag : int { kALocal1x64 = 1, kBLocal1x64 = 2, kEmitAmax = 4 };
}  // namespace gemm

}  // namespace codes
}  // namespace jax_fp4
