// The one Python extension: `registrations()` maps each FFI target name to a capsule holding its handler.
#include <nanobind/nanobind.h>

#include <cstddef>
#include <string>

#include "common/ffi_module.h"
#include "xla/ffi/api/api.h"

namespace nb = nanobind;

// Set by CMakeLists.txt from the --generate-code flags and the CUDA compiler (e.g. "sm_90a,sm_100a,compute_90").
#ifndef JAX_FP4_CUDA_ARCHS
#define JAX_FP4_CUDA_ARCHS ""
#endif
#ifndef JAX_FP4_CUDA_COMPILER_VERSION
#define JAX_FP4_CUDA_COMPILER_VERSION ""
#endif

XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_amax);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_quantize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_rht_amax);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_dequantize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_swizzle);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_unswizzle);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_grouped_quantize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_grouped_dequantize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_gemm);

namespace {

constexpr jax_fp4::FfiTarget kTargets[] = {
    {"jf4_amax", jf4_amax},
    {"jf4_quantize", jf4_quantize},
    {"jf4_rht_amax", jf4_rht_amax},
    {"jf4_dequantize", jf4_dequantize},
    {"jf4_swizzle", jf4_swizzle},
    {"jf4_unswizzle", jf4_unswizzle},
    {"jf4_grouped_quantize", jf4_grouped_quantize},
    {"jf4_grouped_dequantize", jf4_grouped_dequantize},
    {"jf4_gemm", jf4_gemm},
};

}  // namespace

NB_MODULE(_jax_fp4_cuda, m) {
  m.doc() = "jax_fp4 CUDA kernels as XLA FFI handlers (register with jax.ffi.register_ffi_target, platform='CUDA').";
  nb::list archs;
  std::string all = JAX_FP4_CUDA_ARCHS;
  for (size_t start = 0; start < all.size();) {
    size_t end = all.find(',', start);
    if (end == std::string::npos) end = all.size();
    if (end > start) archs.append(nb::str(all.c_str() + start, end - start));
    start = end + 1;
  }
  m.attr("cuda_architectures") = nb::steal(PySequence_Tuple(archs.ptr()));
  m.attr("cuda_compiler_version") = nb::str(JAX_FP4_CUDA_COMPILER_VERSION);
  jax_fp4::DefRegistrations(m, kTargets, "Return {target_name: PyCapsule} for every FFI handler in this extension.");
}
