// FFI handler `jf4_amax`: out[] (fp32 scalar) = fmax-reduction of |x| over every element of x (bf16/f16/f32).
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "amax/amax.cuh"
#include "common/errors.h"
#include "common/sm_count.h"
#include "common/ffi_utils.h"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace {

template <typename Bits>
ffi::Error Launch(const ffi::AnyBuffer& x, size_t n, float* out, cudaStream_t stream) {
  int num_sms = 0;
  JF4_CUDA_CHECK(NumSms(&num_sms));
  const auto* data = static_cast<const typename Bits::storage*>(x.untyped_data());
  JF4_CUDA_CHECK((amax::LaunchAmax<Bits>(data, n, out, num_sms, stream)));
  return ffi::Error::Success();
}

ffi::Error AmaxImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  JF4_CHECK(ElementCount(*out) == 1,
            "jf4_amax: output must hold one float32, got " + std::to_string(ElementCount(*out)) + " elements");
  const size_t n = ElementCount(x);
  JF4_CHECK(n == 0 || x.untyped_data() != nullptr, "jf4_amax: null input buffer");
  float* out_ptr = out->typed_data();
  return DispatchFloat(x.element_type(), "jf4_amax: x", [&](auto tag) -> ffi::Error {
    using Tag = decltype(tag);
    if constexpr (Tag::kDataType == ffi::DataType::BF16) return Launch<amax::Bf16Bits>(x, n, out_ptr, stream);
    else if constexpr (Tag::kDataType == ffi::DataType::F16) return Launch<amax::F16Bits>(x, n, out_ptr, stream);
    else return Launch<amax::F32Bits>(x, n, out_ptr, stream);
  });
}

}  // namespace
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(jf4_amax, jax_fp4::AmaxImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
