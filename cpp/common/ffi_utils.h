// Helpers for XLA FFI buffers shared by all handlers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "common/errors.h"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {

// Number of logical elements of a buffer (product of its dimensions; 1 for rank 0, 0 if any dimension is 0).
// For packed sub-byte types (float4_e2m1fn) this is the logical count, not the byte count.
template <typename BufferT>
inline size_t ElementCount(const BufferT& buffer) {
  size_t n = 1;
  for (int64_t d : buffer.dimensions()) n *= static_cast<size_t>(d);
  return n;
}

// Human-readable dtype name for error messages.
inline const char* DataTypeName(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    case ffi::DataType::F8E8M0FNU: return "float8_e8m0fnu";
    case ffi::DataType::F4E2M1FN: return "float4_e2m1fn";
    default: return "unsupported";
  }
}

// Storage types for dispatch (bit-level kernels only need the width; device code reinterprets).
struct Bf16Tag { using storage = uint16_t; static constexpr ffi::DataType kDataType = ffi::DataType::BF16; };
struct F16Tag { using storage = uint16_t; static constexpr ffi::DataType kDataType = ffi::DataType::F16; };
struct F32Tag { using storage = uint32_t; static constexpr ffi::DataType kDataType = ffi::DataType::F32; };

// Calls fn(Tag{}) for a bfloat16 / float16 / float32 dtype and returns its ffi::Error; any other dtype gives
// ffi::Error::InvalidArgument naming the dtype and `what` (the operand).
template <typename Fn>
inline ffi::Error DispatchFloat(ffi::DataType dtype, const char* what, Fn&& fn) {
  switch (dtype) {
    case ffi::DataType::BF16: return std::forward<Fn>(fn)(Bf16Tag{});
    case ffi::DataType::F16: return std::forward<Fn>(fn)(F16Tag{});
    case ffi::DataType::F32: return std::forward<Fn>(fn)(F32Tag{});
    default:
      return ffi::Error::InvalidArgument(std::string(what) + ": unsupported dtype " + DataTypeName(dtype) +
                                         " (expected bfloat16, float16 or float32)");
  }
}

// Handler signatures: BindArgs<T1, T2, ...>(b) is std::move(b).Arg<T1>().Arg<T2>()..., BindRets<...>(b) likewise
// with Ret, and BindAttrs<T>(b, "a", "b", ...) binds one attribute of type T per name, in order. (An xla::ffi::Binding
// cannot be moved into a new object, only consumed by its && members, hence the references and no named results.)
template <bool kRet, typename T, typename Binding>
auto BindOne(Binding&& b) {
  if constexpr (kRet) {
    return std::move(b).template Ret<T>();
  } else {
    return std::move(b).template Arg<T>();
  }
}
template <bool kRet, typename T, typename... Ts, typename Binding>
auto BindEach(Binding&& b) {
  if constexpr (sizeof...(Ts) == 0) {
    return BindOne<kRet, T>(std::move(b));
  } else {
    return BindEach<kRet, Ts...>(BindOne<kRet, T>(std::move(b)));
  }
}
template <typename... Ts, typename Binding>
auto BindArgs(Binding&& b) {
  return BindEach<false, Ts...>(std::move(b));
}
template <typename... Ts, typename Binding>
auto BindRets(Binding&& b) {
  return BindEach<true, Ts...>(std::move(b));
}
template <typename T, typename Binding, typename... Names>
auto BindAttrs(Binding&& b, const char* name, Names... names) {
  if constexpr (sizeof...(Names) == 0) {
    return std::move(b).template Attr<T>(name);
  } else {
    return BindAttrs<T>(std::move(b).template Attr<T>(name), names...);
  }
}

}  // namespace jax_fp4
