// FFI handler `jf4_gemm`: the block-scaled GEMM of two K-major quantized operands on Hopper (gemm/gemm_sm90.cuh).
//
// Operands: a_data [M, K] (float4_e2m1fn packed two per byte, or float8_e4m3fn / float8_e5m2), a_scale [M, K / bs]
// compact block scales (float8_e4m3fn for NVFP4, float8_e8m0fnu for MXFP8), a_aux float32 (NVFP4 tensor amax [],
// NVFP4 1x64 window amax [M, K / 64], MXFP8 [0]), then b_data, b_scale, b_aux likewise for B [N, K], then bias
// float32 [N] or [0]. Results: out [M, N] bfloat16 or float32, out_amax float32 [] (max |out|, NaN if any output is
// NaN; written only with GemmFlag kEmitAmax). Attributes: a_kind, b_kind (codes::Kind), flags (codes::gemm::Flag).
// Every size is checked against M, N, K, so a mismatched call is an InvalidArgument error, never an out-of-bounds
// access. Compiled for sm_90a only (WGMMA): another compute capability gets an Unimplemented error. Command-buffer
// compatible: a memset of out_amax and one launch on the stream, no host sync, no allocation.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "common/errors.h"
#include "common/ffi_codes.h"
#include "common/ffi_utils.h"
#include "common/sm_count.h"
#include "gemm/gemm_sm90.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace {

using gemm::Params;

// Raises the kernel's dynamic shared memory limit once per device (a host-side function attribute, set outside any
// CUDA-graph capture after the first call on the device). `done` belongs to one kernel: every GemmKernel variant has
// the same function type, so a static here would be shared by all of them and only the first would get its limit.
template <typename Kernel>
cudaError_t AllowSharedMemory(Kernel* kernel, int bytes, std::atomic<uint64_t>& done) {
  // done, bit d: set on device d (devices 0..63; others set it every call)
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t(1) << device : 0;
  if (bit && (done.load(std::memory_order_acquire) & bit)) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && bit) done.fetch_or(bit, std::memory_order_release);
  return err;
}

template <bool kFp4A, bool kFp4B, bool kLocal>
cudaError_t Launch(const Params& p, cudaStream_t stream) {
  auto* kernel = gemm::GemmKernel<kFp4A, kFp4B, kLocal>;
  using Cfg = gemm::Config<kFp4A, kFp4B, kLocal>;
  constexpr int kSmem = int(sizeof(typename Cfg::SharedStorage));
  static std::atomic<uint64_t> done{0};  // per <kFp4A, kFp4B, kLocal> instantiation
  cudaError_t err = AllowSharedMemory(kernel, kSmem, done);
  if (err != cudaSuccess) return err;
  const int64_t tiles = ((p.M + gemm::kBM - 1) / gemm::kBM) * ((p.N + Cfg::kBN - 1) / Cfg::kBN);
  kernel<<<dim3(unsigned(tiles)), dim3(gemm::kThreads), kSmem, stream>>>(p);
  return cudaGetLastError();
}

struct Operand {
  const char* name;
  int kind;
  bool fp4, local, tensor;
};

// Checks one operand's buffers against [rows, K] and its kind; fills `op`.
ffi::Error CheckOperand(const char* name, int kind, bool local, const ffi::AnyBuffer& data,
                        const ffi::AnyBuffer& scale, const ffi::Buffer<ffi::F32>& aux, int64_t* rows, int64_t* K,
                        Operand* op) {
  const std::string where = std::string("jf4_gemm: ") + name;
  JF4_CHECK(kind == codes::kNvfp4 || kind == codes::kMxfp8E4m3 || kind == codes::kMxfp8E5m2,
            where + ": unknown kind " + std::to_string(kind));
  const bool fp4 = kind == codes::kNvfp4;
  const ffi::DataType dtype = fp4 ? ffi::DataType::F4E2M1FN
                                  : (kind == codes::kMxfp8E4m3 ? ffi::DataType::F8E4M3FN : ffi::DataType::F8E5M2);
  JF4_CHECK(data.element_type() == dtype, where + "_data dtype " + DataTypeName(data.element_type()) +
                                              " does not match its kind (expected " + DataTypeName(dtype) + ")");
  const auto dims = data.dimensions();
  JF4_CHECK(dims.size() == 2, where + "_data must be rank 2 [rows, K], got rank " + std::to_string(dims.size()));
  *rows = dims[0], *K = dims[1];
  JF4_CHECK(!local || fp4, where + ": the 1x64 flag is for NVFP4 operands");
  const int64_t bs = fp4 ? 16 : 32;
  JF4_CHECK(*K % bs == 0 && (!local || *K % 64 == 0),
            where + "_data: K = " + std::to_string(*K) + " is not a multiple of " + std::to_string(local ? 64 : bs));
  JF4_CHECK(scale.element_type() == (fp4 ? ffi::DataType::F8E4M3FN : ffi::DataType::F8E8M0FNU),
            where + "_scale dtype " + DataTypeName(scale.element_type()));
  const auto sd = scale.dimensions();
  JF4_CHECK(sd.size() == 2 && sd[0] == *rows && sd[1] == *K / bs,
            where + "_scale must be the compact [" + std::to_string(*rows) + ", " + std::to_string(*K / bs) + "]");
  const int64_t n_aux = static_cast<int64_t>(ElementCount(aux));
  bool tensor = false;
  if (local) {
    const auto ad = aux.dimensions();
    JF4_CHECK(ad.size() == 2 && ad[0] == *rows && ad[1] == *K / 64,
              where + "_aux: 1x64 window amax must be [" + std::to_string(*rows) + ", " + std::to_string(*K / 64) +
                  "]");
  } else if (fp4) {
    JF4_CHECK(aux.dimensions().size() == 0, where + "_aux: NVFP4 takes its tensor amax as a float32 scalar []");
    tensor = true;
  } else {
    JF4_CHECK(n_aux == 0, where + "_aux: MXFP8 takes an empty float32 [0] operand");
  }
  *op = Operand{name, kind, fp4, local, tensor};
  return ffi::Error::Success();
}

ffi::Error GemmImpl(cudaStream_t stream, ffi::AnyBuffer a_data, ffi::AnyBuffer a_scale, ffi::Buffer<ffi::F32> a_aux,
                    ffi::AnyBuffer b_data, ffi::AnyBuffer b_scale, ffi::Buffer<ffi::F32> b_aux,
                    ffi::Buffer<ffi::F32> bias, ffi::Result<ffi::AnyBuffer> out,
                    ffi::Result<ffi::Buffer<ffi::F32>> out_amax, int32_t a_kind, int32_t b_kind, int32_t flags) {
  JF4_CHECK((flags & ~(codes::gemm::kALocal1x64 | codes::gemm::kBLocal1x64 | codes::gemm::kEmitAmax)) == 0,
            "jf4_gemm: unknown flag bits in " + std::to_string(flags));
  const bool a_local = flags & codes::gemm::kALocal1x64, b_local = flags & codes::gemm::kBLocal1x64;
  JF4_CHECK(a_local == b_local, "jf4_gemm: 1x64 operands pair only with 1x64 operands (flags " +
                                    std::to_string(flags) + ")");
  int64_t M = 0, N = 0, K = 0, Kb = 0;
  Operand A{}, B{};
  JF4_RETURN_IF_ERROR(CheckOperand("a", a_kind, a_local, a_data, a_scale, a_aux, &M, &K, &A));
  JF4_RETURN_IF_ERROR(CheckOperand("b", b_kind, b_local, b_data, b_scale, b_aux, &N, &Kb, &B));
  const std::string where = "jf4_gemm: a [" + std::to_string(M) + ", " + std::to_string(K) + "] x b [" +
                            std::to_string(N) + ", " + std::to_string(Kb) + "]";
  JF4_CHECK(K == Kb, where + ": the contracting sizes differ");
  const int64_t n_bias = static_cast<int64_t>(ElementCount(bias));
  JF4_CHECK(bias.dimensions().size() == 1 && (n_bias == N || n_bias == 0),
            where + ": bias must be float32 [N] or [0], got " + std::to_string(n_bias) + " elements");
  const auto od = out->dimensions();
  JF4_CHECK(od.size() == 2 && od[0] == M && od[1] == N, where + ": out must be [M, N]");
  const ffi::DataType odt = out->element_type();
  JF4_CHECK(odt == ffi::DataType::BF16 || odt == ffi::DataType::F32,
            where + ": out dtype " + DataTypeName(odt) + " (expected bfloat16 or float32)");
  JF4_CHECK(out_amax->dimensions().size() == 0, where + ": out_amax must be a float32 scalar []");
  JF4_CHECK(M < (int64_t(1) << 31) && N < (int64_t(1) << 31) && K < (int64_t(1) << 31) - 64,
            where + ": sizes must stay below 2^31 (K below 2^31 - 64)");
  const int64_t tiles = ((M + gemm::kBM - 1) / gemm::kBM) * ((N + 127) / 128);  // the most of either tiling
  JF4_CHECK(tiles < (int64_t(1) << 31), where + ": too many output tiles");

  int cc = 0;
  JF4_CUDA_CHECK(ComputeCapability(&cc));
  if (cc != 90) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      where + ": the jf4_gemm kernel is built for sm_90a (Hopper) only; this device has compute "
                              "capability " + std::to_string(cc / 10) + "." + std::to_string(cc % 10));
  }
  const bool emit_amax = flags & codes::gemm::kEmitAmax;
  if (emit_amax) JF4_CUDA_CHECK(cudaMemsetAsync(out_amax->typed_data(), 0, sizeof(float), stream));
  if (M == 0 || N == 0) return ffi::Error::Success();

  Params p{};
  p.a = static_cast<const uint8_t*>(a_data.untyped_data());
  p.a_scale = static_cast<const uint8_t*>(a_scale.untyped_data());
  p.a_aux = a_aux.typed_data();
  p.b = static_cast<const uint8_t*>(b_data.untyped_data());
  p.b_scale = static_cast<const uint8_t*>(b_scale.untyped_data());
  p.b_aux = b_aux.typed_data();
  p.bias = n_bias ? bias.typed_data() : nullptr;
  p.out = out->untyped_data();
  p.out_amax = emit_amax ? reinterpret_cast<unsigned*>(out_amax->typed_data()) : nullptr;
  p.M = M, p.N = N, p.K = K;
  p.a_e5m2 = a_kind == codes::kMxfp8E5m2, p.b_e5m2 = b_kind == codes::kMxfp8E5m2;
  p.a_tensor = A.tensor, p.b_tensor = B.tensor;
  p.out_f32 = odt == ffi::DataType::F32;
  // The vector loads need 8-byte (NVFP4) / 16-byte (MXFP8) aligned rows: K % 16 / K % 32 and aligned bases.
  for (const void* ptr : {static_cast<const void*>(p.a), static_cast<const void*>(p.b)}) {
    JF4_CHECK(reinterpret_cast<uintptr_t>(ptr) % 16 == 0, where + ": operand data must be 16-byte aligned");
  }
  if (A.local) {
    JF4_CUDA_CHECK((Launch<true, true, true>(p, stream)));
  } else if (A.fp4 && B.fp4) {
    JF4_CUDA_CHECK((Launch<true, true, false>(p, stream)));
  } else if (A.fp4) {
    JF4_CUDA_CHECK((Launch<true, false, false>(p, stream)));
  } else if (B.fp4) {
    JF4_CUDA_CHECK((Launch<false, true, false>(p, stream)));
  } else {
    JF4_CUDA_CHECK((Launch<false, false, false>(p, stream)));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(jf4_gemm, jax_fp4::GemmImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int32_t>("a_kind")
                                  .Attr<int32_t>("b_kind")
                                  .Attr<int32_t>("flags"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
