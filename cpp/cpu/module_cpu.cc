// The CPU extension: `registrations()` maps each FFI target name to a capsule holding its host handler (registered
// with jax.ffi.register_ffi_target(..., platform="cpu") under the same names as the CUDA targets).
#include <nanobind/nanobind.h>

#include "common/ffi_module.h"
#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_cpu_amax);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_cpu_quantize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_cpu_rht_amax);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_cpu_dequantize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_cpu_swizzle);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_cpu_unswizzle);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_cpu_grouped_quantize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_cpu_grouped_dequantize);

namespace {

constexpr jax_fp4::FfiTarget kTargets[] = {
    {"jf4_amax", jf4_cpu_amax},
    {"jf4_quantize", jf4_cpu_quantize},
    {"jf4_rht_amax", jf4_cpu_rht_amax},
    {"jf4_dequantize", jf4_cpu_dequantize},
    {"jf4_swizzle", jf4_cpu_swizzle},
    {"jf4_unswizzle", jf4_cpu_unswizzle},
    {"jf4_grouped_quantize", jf4_cpu_grouped_quantize},
    {"jf4_grouped_dequantize", jf4_cpu_grouped_dequantize},
};

}  // namespace

NB_MODULE(_jax_fp4_cpu, m) {
  m.doc() = "jax_fp4 host kernels as XLA FFI handlers (register with jax.ffi.register_ffi_target, platform='cpu').";
  jax_fp4::DefRegistrations(m, kTargets,
                            "Return {target_name: PyCapsule} for every CPU FFI handler in this extension.");
}
