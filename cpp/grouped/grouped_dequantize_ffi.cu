// FFI handler `jf4_grouped_dequantize`: one orientation's grouped NVFP4 / MXFP8 data + compact scales (+ per-group
// amax) -> f32 / bf16 / f16 values in x's layout (grouped_dequantize.cuh), group sizes read on the device only.
//
// Operands: data [size] (float4_e2m1fn / float8_e4m3fn / float8_e5m2), scale [size / block] (float8_e4m3fn NVFP4,
// float8_e8m0fnu MXFP8), amax f32[N] (NVFP4 unless raw, else f32[0]), first_dims and last_dims int32[N], then any
// number of ignored operands (a test aliases a poisoned buffer to the result). Result: out [x_shape] (size elements,
// any shape). Attributes: kind (dequantize::Kind), flags (kColumnwise | kRht | kRaw below). Every size is checked,
// so a mismatched call is an InvalidArgument error, never an out-of-bounds access. Command-buffer compatible: one
// launch, no host sync, no allocation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/errors.h"
#include "common/ffi_codes.h"
#include "common/ffi_utils.h"
#include "grouped/group_table.cuh"
#include "grouped/grouped_dequantize.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace {

constexpr int32_t kColumnwise = codes::grouped_dequantize::kColumnwise, kRht = codes::grouped_dequantize::kRht,
                  kRaw = codes::grouped_dequantize::kRaw;

template <typename Out, int kKind, int kTiles = grouped::kNoTiles>
ffi::Error Launch(const grouped::DequantArgs& a, cudaStream_t stream) {
  const size_t smem = grouped::TableBytes(a.n);
  unsigned grid = 0;
  JF4_CUDA_CHECK(grouped::PersistentGrid(grouped::GroupedDequantizeKernel<Out, kKind, kTiles>, smem, &grid));
  grouped::GroupedDequantizeKernel<Out, kKind, kTiles><<<grid, grouped::kThreads, smem, stream>>>(a);
  JF4_CUDA_CHECK(cudaGetLastError());
  return ffi::Error::Success();
}

template <typename Out>
ffi::Error LaunchKind(int kind, const grouped::DequantArgs& a, cudaStream_t stream) {
  switch (kind) {
    case dequantize::kNvfp4:  // columnwise: the transposed-tile instantiation of the call's variant
      if (a.col && a.rht && !a.raw) return Launch<Out, dequantize::kNvfp4, dequantize::kTransposeRht>(a, stream);
      if (a.col) return Launch<Out, dequantize::kNvfp4, dequantize::kTransposePlain>(a, stream);
      return Launch<Out, dequantize::kNvfp4>(a, stream);
    case dequantize::kMxfp8E4m3: return Launch<Out, dequantize::kMxfp8E4m3>(a, stream);
    default: return Launch<Out, dequantize::kMxfp8E5m2>(a, stream);
  }
}

ffi::Error GroupedDequantizeImpl(cudaStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scale,
                                 ffi::Buffer<ffi::F32> amax, ffi::Buffer<ffi::S32> first_dims,
                                 ffi::Buffer<ffi::S32> last_dims, ffi::RemainingArgs,
                                 ffi::Result<ffi::AnyBuffer> out, int32_t kind, int32_t flags) {
  const int64_t size = static_cast<int64_t>(ElementCount(data));
  const int64_t n = static_cast<int64_t>(ElementCount(first_dims));
  const std::string where = "jf4_grouped_dequantize: data of " + std::to_string(size) + " elements, " +
                            std::to_string(n) + " groups";
  const bool nvfp4 = kind == dequantize::kNvfp4;
  JF4_CHECK(nvfp4 || kind == dequantize::kMxfp8E4m3 || kind == dequantize::kMxfp8E5m2,
            where + ": unknown kind " + std::to_string(kind));
  JF4_CHECK((flags & ~(kColumnwise | kRht | kRaw)) == 0 && (nvfp4 || (flags & (kRht | kRaw)) == 0),
            where + ": unsupported flags " + std::to_string(flags));
  const ffi::DataType mx = kind == dequantize::kMxfp8E4m3 ? ffi::DataType::F8E4M3FN : ffi::DataType::F8E5M2;
  const ffi::DataType dtype = nvfp4 ? ffi::DataType::F4E2M1FN : mx;
  JF4_CHECK(size == 0 || data.element_type() == dtype, where + ": data dtype " + DataTypeName(data.element_type()));
  JF4_CHECK(size < (int64_t(1) << 31), where + ": data must have fewer than 2**31 elements");
  JF4_CHECK(n >= 1 && n <= grouped::kMaxGroups, where + ": the kernel takes 1.." +
                                                    std::to_string(grouped::kMaxGroups) + " groups");
  JF4_CHECK(static_cast<int64_t>(ElementCount(last_dims)) == n, where + ": last_dims must hold N int32");
  const int64_t bs = nvfp4 ? 16 : 32;
  JF4_CHECK(static_cast<int64_t>(ElementCount(scale)) == size / bs,
            where + ": scale must hold size / " + std::to_string(bs) + " elements, got " +
                std::to_string(ElementCount(scale)));
  JF4_CHECK(size / bs == 0 || scale.element_type() == (nvfp4 ? ffi::DataType::F8E4M3FN : ffi::DataType::F8E8M0FNU),
            where + ": scale dtype " + DataTypeName(scale.element_type()));
  const bool raw = flags & kRaw;
  const bool tensor_scale = nvfp4 && !raw;
  JF4_CHECK(static_cast<int64_t>(ElementCount(amax)) == (tensor_scale ? n : 0),
            where + ": amax must be float32[N] for NVFP4 (not raw), else float32[0]");
  JF4_CHECK(static_cast<int64_t>(ElementCount(*out)) == size, where + ": the output must hold size elements");
  const ffi::DataType od = out->element_type();
  JF4_CHECK(od == ffi::DataType::F32 || od == ffi::DataType::BF16 || od == ffi::DataType::F16,
            where + ": output dtype " + DataTypeName(od) + " (expected float32, bfloat16 or float16)");

  grouped::DequantArgs a{};
  a.data = static_cast<const uint8_t*>(data.untyped_data());
  a.scale = static_cast<const uint8_t*>(scale.untyped_data());
  a.amax = tensor_scale ? amax.typed_data() : nullptr;
  a.out = out->untyped_data();
  a.size = size;
  a.n = static_cast<int>(n);
  a.first_dims = first_dims.typed_data();
  a.last_dims = last_dims.typed_data();
  a.col = flags & kColumnwise;
  a.rht = nvfp4 && (flags & kRht);
  a.raw = raw;
  if (size == 0) return ffi::Error::Success();
  JF4_CHECK(a.data != nullptr && a.out != nullptr && (size < bs || a.scale != nullptr), where + ": null buffer");
  switch (od) {
    case ffi::DataType::F32: return LaunchKind<float>(kind, a, stream);
    case ffi::DataType::BF16: return LaunchKind<__nv_bfloat16>(kind, a, stream);
    default: return LaunchKind<__half>(kind, a, stream);
  }
}

}  // namespace
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(jf4_grouped_dequantize, jax_fp4::GroupedDequantizeImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int32_t>("kind")
                                  .Attr<int32_t>("flags"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
