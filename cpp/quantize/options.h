// The format kinds and NVFP4 option bits of one quantize orientation under the short names of the quantize code:
// the CUDA kernels (quantize_parts.cuh, grouped/grouped_quantize.cuh) and the CPU quantize handlers
// (cpu/quantize_cpu.h), which share one definition. The values are the jf4_quantize attribute codes
// (common/ffi_codes.h). No CUDA header: the host C++ compiler builds it as well as nvcc.
#pragma once

#include "common/ffi_codes.h"

namespace jax_fp4 {
namespace quantize {

using codes::Kind;
using codes::kMxfp8E4m3;
using codes::kMxfp8E5m2;
using codes::kNone;
using codes::kNvfp4;
// One orientation's NVFP4 options: the row options, or the col options (flags >> codes::quantize::kColShift).
enum Option : int {
  kSr = codes::quantize::kSr, kRht = codes::quantize::kRht, k2d = codes::quantize::kScaling2d,
  k1x64 = codes::quantize::kLocal1x64, k4over6 = codes::quantize::kUse4over6, kBound256 = codes::quantize::kE4m3Max256,
  kMse = codes::quantize::kErrMse
};
// The E4M3 bound of an orientation's tensor scale (NVFP4.global_e4m3_max).
constexpr float E4m3Bound(int opts) { return (opts & kBound256) ? 256.0f : 448.0f; }

}  // namespace quantize
}  // namespace jax_fp4
