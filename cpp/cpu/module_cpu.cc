// The CPU extension: `registrations()` maps each FFI target name to a capsule holding its host handler (registered
// with jax.ffi.register_ffi_target(..., platform="cpu") under the same names as the CUDA targets).
#include <nanobind/nanobind.h>

#include <type_traits>

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_cpu_amax);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_cpu_quantize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_cpu_rht_amax);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_cpu_dequantize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_cpu_swizzle);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_cpu_unswizzle);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_cpu_grouped_quantize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jf4_cpu_grouped_dequantize);

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_jax_fp4_cpu, m) {
  m.doc() = "jax_fp4 host kernels as XLA FFI handlers (register with jax.ffi.register_ffi_target, platform='cpu').";
  m.def(
      "registrations",
      []() {
        nb::dict d;
        d["jf4_amax"] = EncapsulateFfiHandler(jf4_cpu_amax);
        d["jf4_quantize"] = EncapsulateFfiHandler(jf4_cpu_quantize);
        d["jf4_rht_amax"] = EncapsulateFfiHandler(jf4_cpu_rht_amax);
        d["jf4_dequantize"] = EncapsulateFfiHandler(jf4_cpu_dequantize);
        d["jf4_swizzle"] = EncapsulateFfiHandler(jf4_cpu_swizzle);
        d["jf4_unswizzle"] = EncapsulateFfiHandler(jf4_cpu_unswizzle);
        d["jf4_grouped_quantize"] = EncapsulateFfiHandler(jf4_cpu_grouped_quantize);
        d["jf4_grouped_dequantize"] = EncapsulateFfiHandler(jf4_cpu_grouped_dequantize);
        return d;
      },
      "Return {target_name: PyCapsule} for every CPU FFI handler in this extension.");
}
