// The part the two extension modules share (module.cc: the CUDA handlers, cpu/module_cpu.cc: the host handlers):
// each lists its FFI targets as {target name, handler} and exposes them as `registrations()` -> {target name:
// PyCapsule}, which jax_fp4/_src/ffi.py passes to jax.ffi.register_ffi_target. Host C++ only (nanobind).
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>

#include "xla/ffi/api/c_api.h"

namespace jax_fp4 {

// One FFI target: the name it is registered under and its handler (a function declared with
// XLA_FFI_DECLARE_HANDLER_SYMBOL; the pointer type admits nothing else).
struct FfiTarget {
  const char* name;
  XLA_FFI_Handler* handler;
};

// Defines m.registrations(), returning {name: PyCapsule(handler)} for every entry of `targets` (a table with static
// storage duration, which outlives the module), with the docstring `doc`.
template <std::size_t N>
void DefRegistrations(nanobind::module_& m, const FfiTarget (&targets)[N], const char* doc) {
  m.def(
      "registrations",
      [&targets]() {
        nanobind::dict d;
        for (const FfiTarget& t : targets) d[t.name] = nanobind::capsule(reinterpret_cast<void*>(t.handler));
        return d;
      },
      doc);
}

}  // namespace jax_fp4
