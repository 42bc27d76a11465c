// Static tile scheduling of grouped (MoE) kernels (docs/numerics.md section 4): one persistent launch for all groups.
//
// Every thread block first builds the group table in shared memory from the device-resident group dims (nothing is
// copied to the host, so the handlers are CUDA-graph safe): clamped dims, element offsets (an exclusive scan of
// M_g * K_g, clamped to the buffer), and an exclusive scan of each group's work units (a kernel-specific count:
// 64x64 tiles, chunks of blocks, ...), with one extra pseudo-group N for the buffer tail past the last group. The
// block then walks units blockIdx.x, blockIdx.x + gridDim.x, ... (the grouped quantize kernel: blockIdx.x, then the
// units it claims from a counter) and binary-searches each unit's group. All threads of a block share the unit, so
// the barriers of the per-unit routines are uniform.
//
// The table lives in dynamic shared memory (TableBytes(N)); N <= kMaxGroups.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstdint>

#include "common/sm_count.h"

namespace jax_fp4 {
namespace grouped {

constexpr int kThreads = 256;
constexpr int kMaxGroups = 1024;
constexpr int kMaxPerThread = (kMaxGroups + 1 + kThreads - 1) / kThreads;  // table items per thread in the scans

struct Table {
  int32_t* off;    // [N + 1] element offsets, min(sum_{i<g} M_i K_i, size)
  int32_t* rows;   // [N] max(first_dims[g], 0)
  int32_t* cols;   // [N] max(last_dims[g], 0)
  int32_t* units;  // [N + 2] exclusive prefix of work units; group N is the tail, units[N + 1] the total
  int n;
  int64_t size;    // elements of the buffer

  __device__ __forceinline__ int64_t Count(int g) const { return int64_t(off[g + 1]) - off[g]; }
  // M_g * K_g (not clamped to the buffer).
  __device__ __forceinline__ int64_t Numel(int g) const { return int64_t(rows[g]) * cols[g]; }
  // The whole group lies inside the buffer.
  __device__ __forceinline__ bool Inside(int g) const { return int64_t(off[g]) + Numel(g) <= size; }
  __device__ __forceinline__ int32_t Total() const { return units[n + 1]; }
};

__host__ __device__ __forceinline__ size_t TableBytes(int n) { return sizeof(int32_t) * size_t(4 * n + 3); }

__device__ __forceinline__ Table CarveTable(void* smem, int n, int64_t size) {
  int32_t* p = static_cast<int32_t*>(smem);
  return Table{p, p + (n + 1), p + (2 * n + 1), p + (3 * n + 1), n, size};
}

// Row-major index in the transpose [k, m] -> canonical row-major [m, k] index (reference.grouped._o2c: m of zero
// counts as 1 in the division). local < 2^32 (a group-local index plus a block of padding), so the division is
// 32-bit.
__device__ __forceinline__ int64_t O2C(int64_t local, int64_t m, int64_t k) {
  const uint32_t m1 = m > 0 ? uint32_t(m) : 1u, l = uint32_t(local);
  const uint32_t q = l / m1;
  return int64_t(l - q * m1) * k + q;
}

__device__ __forceinline__ int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Exclusive scan of one int64 per thread over the block; *total gets the sum. Every thread must call it.
__device__ __forceinline__ int64_t BlockExclusiveScan(int64_t v, int64_t* total) {
  __shared__ int64_t warp_sums[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int64_t inc = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t y = __shfl_up_sync(0xffffffffu, inc, d);
    if (lane >= d) inc += y;
  }
  if (lane == 31) warp_sums[warp] = inc;
  __syncthreads();
  int64_t base = 0, tot = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) {
    const int64_t s = warp_sums[w];
    if (w < warp) base += s;
    tot += s;
  }
  __syncthreads();  // warp_sums is reused by the next scan
  *total = tot;
  return base + inc - v;
}

// Builds the table. units_fn(t, g) -> int64 work units of group g (g == N: the tail); it may read t.off / rows / cols.
template <typename UnitsFn>
__device__ __forceinline__ void BuildTable(Table& t, const int32_t* __restrict__ first_dims,
                                           const int32_t* __restrict__ last_dims, UnitsFn units_fn) {
  const int n = t.n;
  for (int g = threadIdx.x; g < n; g += kThreads) {
    const int32_t r = __ldg(first_dims + g), c = __ldg(last_dims + g);
    t.rows[g] = r > 0 ? r : 0;
    t.cols[g] = c > 0 ? c : 0;
  }
  __syncthreads();
  // Offsets: thread i scans items [i * per, (i + 1) * per). Each size is clamped to size + 1 first (no int64
  // overflow for any traced sizes; min(prefix, size) is unchanged).
  const int per = (n + 1 + kThreads - 1) / kThreads;
  const int g0 = min(n + 1, int(threadIdx.x) * per), g1 = min(n + 1, g0 + per);
  int64_t sizes[kMaxPerThread];
  int64_t s = 0;
#pragma unroll
  for (int i = 0; i < kMaxPerThread; ++i) {
    const int g = g0 + i;
    int64_t v = 0;
    if (g < g1 && g < n) {
      v = t.Numel(g);
      v = v < t.size + 1 ? v : t.size + 1;
    }
    sizes[i] = v;
    s += v;
  }
  int64_t total;
  int64_t base = BlockExclusiveScan(s, &total);
#pragma unroll
  for (int i = 0; i < kMaxPerThread; ++i) {
    const int g = g0 + i;
    if (g < g1) t.off[g] = int32_t(base < t.size ? base : t.size);  // g == n: the end of the last group
    base += sizes[i];
  }
  __syncthreads();
  // Work units of groups 0..N-1 and the tail N.
  s = 0;
#pragma unroll
  for (int i = 0; i < kMaxPerThread; ++i) {
    const int g = g0 + i;
    const int64_t v = g < g1 ? units_fn(t, g) : 0;
    sizes[i] = v;
    s += v;
  }
  base = BlockExclusiveScan(s, &total);
#pragma unroll
  for (int i = 0; i < kMaxPerThread; ++i) {
    const int g = g0 + i;
    if (g < g1) t.units[g] = int32_t(base < INT_MAX ? base : INT_MAX);
    base += sizes[i];
  }
  if (threadIdx.x == 0) t.units[n + 1] = int32_t(total < INT_MAX ? total : INT_MAX);
  __syncthreads();
}

// The group (0..N, N = tail) of work unit u < Total(): the largest g with units[g] <= u (empty groups are skipped).
__device__ __forceinline__ int FindGroup(const Table& t, int32_t u) {
  int lo = 0, hi = t.n;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (t.units[mid] <= u) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Block-wide max of a non-negative float (as its bit pattern); the result is valid in thread 0.
__device__ __forceinline__ uint32_t BlockMaxBits(uint32_t v) {
  __shared__ uint32_t warp_max[kThreads / 32];
  v = __reduce_max_sync(0xffffffffu, v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  uint32_t m = 0;
  if (warp == 0) {
    m = lane < kThreads / 32 ? warp_max[lane] : 0u;
    m = __reduce_max_sync(0xffffffffu, m);
  }
  __syncthreads();  // warp_max is reused by the next call
  return m;
}

// ---- host side ----------------------------------------------------------------------------------------------------
// Persistent grid: as many blocks as are resident at once (every block then grid-strides over the units).
template <typename Kernel>
cudaError_t PersistentGrid(Kernel kernel, size_t smem_bytes, unsigned* grid) {
  return jax_fp4::PersistentGrid(kernel, kThreads, smem_bytes, grid);
}

}  // namespace grouped
}  // namespace jax_fp4
