// The SM count of the current device, for sizing persistent grids (cpp/amax/, cpp/grouped/).
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace jax_fp4 {

// SM count of the current device, cached per device (host-only queries: valid during CUDA-graph capture).
inline cudaError_t NumSms(int* num_sms) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const bool cacheable = device >= 0 && device < kMaxDevices;
  if (cacheable) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) {
      *num_sms = cached;
      return cudaSuccess;
    }
  }
  err = cudaDeviceGetAttribute(num_sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess && cacheable) cache[device].store(*num_sms, std::memory_order_relaxed);
  return err;
}

}  // namespace jax_fp4
