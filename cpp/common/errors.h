// Error helpers for FFI handlers: every failure becomes an ffi::Error carrying file:line. Never throw, never exit.
#pragma once

#if defined(__CUDACC__)
#include <cuda_runtime_api.h>
#endif

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {

namespace ffi = xla::ffi;

inline std::string SourceLocation(const char* file, int line) { return std::string(file) + ":" + std::to_string(line); }

}  // namespace jax_fp4

#define JF4_STRINGIFY_IMPL(x) #x
#define JF4_STRINGIFY(x) JF4_STRINGIFY_IMPL(x)

// JF4_CHECK(cond, msg): return ffi::Error::InvalidArgument("file:line: msg") from the enclosing handler if !cond.
// `msg` is anything convertible to std::string (a literal, or a std::string built with std::to_string).
#define JF4_CHECK(cond, msg)                                                                      \
  do {                                                                                            \
    if (!(cond)) {                                                                                \
      return ::xla::ffi::Error::InvalidArgument(::jax_fp4::SourceLocation(__FILE__, __LINE__) +   \
                                                ": check failed: " #cond ": " + std::string(msg)); \
    }                                                                                             \
  } while (0)

#if defined(__CUDACC__)
// JF4_CUDA_CHECK(call): return ffi::Error::Internal("file:line: call: cudaErrorName: message") on a CUDA error.
#define JF4_CUDA_CHECK(call)                                                                                       \
  do {                                                                                                             \
    cudaError_t jf4_err_ = (call);                                                                                 \
    if (jf4_err_ != cudaSuccess) {                                                                                 \
      return ::xla::ffi::Error::Internal(::jax_fp4::SourceLocation(__FILE__, __LINE__) + ": " #call ": " +         \
                                         cudaGetErrorName(jf4_err_) + ": " + cudaGetErrorString(jf4_err_));        \
    }                                                                                                              \
  } while (0)
#endif  // __CUDACC__

// JF4_RETURN_IF_ERROR(expr): propagate a failed ffi::Error from a helper.
#define JF4_RETURN_IF_ERROR(expr)          \
  do {                                     \
    ::xla::ffi::Error jf4_status_ = (expr); \
    if (jf4_status_.failure()) {           \
      return jf4_status_;                  \
    }                                      \
  } while (0)
