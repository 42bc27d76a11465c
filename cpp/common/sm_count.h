// Cached attributes of the current device (SM count, compute capability) and persistent grid sizes (cpp/amax/,
// cpp/grouped/, cpp/dequantize/, cpp/gemm/).
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace jax_fp4 {

// An attribute of the current device, cached per device and attribute (host-only queries: valid during CUDA-graph
// capture). The cache holds value + 1, so that 0 means "not cached" whatever the attribute's values.
template <cudaDeviceAttr kAttr>
inline cudaError_t DeviceAttribute(int* value) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const bool cacheable = device >= 0 && device < kMaxDevices;
  if (cacheable) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) {
      *value = cached - 1;
      return cudaSuccess;
    }
  }
  err = cudaDeviceGetAttribute(value, kAttr, device);
  if (err == cudaSuccess && cacheable && *value >= 0) cache[device].store(*value + 1, std::memory_order_relaxed);
  return err;
}

// SM count of the current device.
inline cudaError_t NumSms(int* num_sms) { return DeviceAttribute<cudaDevAttrMultiProcessorCount>(num_sms); }

// Compute capability of the current device as major * 10 + minor.
inline cudaError_t ComputeCapability(int* cc) {
  int major = 0, minor = 0;
  cudaError_t err = DeviceAttribute<cudaDevAttrComputeCapabilityMajor>(&major);
  if (err != cudaSuccess) return err;
  if ((err = DeviceAttribute<cudaDevAttrComputeCapabilityMinor>(&minor)) != cudaSuccess) return err;
  *cc = major * 10 + minor;
  return cudaSuccess;
}

// Persistent grid of `kernel` launched with `threads` threads and `smem_bytes` dynamic shared memory: as many blocks
// as are resident at once (host-only queries: valid during CUDA-graph capture).
template <typename Kernel>
cudaError_t PersistentGrid(Kernel kernel, int threads, size_t smem_bytes, unsigned* grid) {
  int sms = 0, per_sm = 0;
  cudaError_t err = NumSms(&sms);
  if (err != cudaSuccess) return err;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem_bytes);
  if (err != cudaSuccess) return err;
  *grid = unsigned((sms > 0 ? sms : 1) * (per_sm > 0 ? per_sm : 1));
  return cudaSuccess;
}

}  // namespace jax_fp4
