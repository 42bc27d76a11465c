// The SM count of the current device and persistent grid sizes (cpp/amax/, cpp/grouped/, cpp/dequantize/).
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
