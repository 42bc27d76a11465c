// The group table of the CPU grouped handlers (cpp/cpu/grouped_quantize_cpu.cc, grouped_dequantize_cpu.cc): the
// geometry of jax_fp4.reference.grouped (docs/numerics.md section 4) read from the host-resident group dims, with the
// clamping of the CUDA kernels' table (cpp/grouped/group_table.cuh): negative dims count as 0, offsets stop at the
// buffer's end (a group overrunning the buffer is truncated).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace jax_fp4 {
namespace cpu {

struct GroupTable {
  int64_t n = 0, size = 0;
  std::vector<int64_t> off;   // [n + 1] element offsets, min(sum_{i<g} M_i K_i, size)
  std::vector<int64_t> rows;  // [n] max(first_dims[g], 0)
  std::vector<int64_t> cols;  // [n] max(last_dims[g], 0)

  GroupTable(const int32_t* first_dims, const int32_t* last_dims, int64_t groups, int64_t buffer)
      : n(groups), size(buffer), off(groups + 1, 0), rows(groups), cols(groups) {
    int64_t prefix = 0;
    for (int64_t g = 0; g < n; ++g) {
      rows[g] = std::max<int32_t>(first_dims[g], 0);
      cols[g] = std::max<int32_t>(last_dims[g], 0);
      prefix = std::min(size, prefix + std::min(rows[g] * cols[g], size + 1));
      off[g + 1] = prefix;
    }
  }
  int64_t Count(int64_t g) const { return off[g + 1] - off[g]; }  // elements inside the buffer
  // The whole group M_g * K_g lies inside the buffer.
  bool Inside(int64_t g) const { return off[g] + rows[g] * cols[g] <= size; }
  // The block axis (rowwise K_g, columnwise M_g) is a whole number of blocks.
  bool Aligned(int64_t g, bool col, int64_t block) const { return (col ? rows[g] : cols[g]) % block == 0; }
  int64_t End() const { return off[n]; }
};

// Index in the transpose [k, m] (row-major) -> canonical row-major [m, k] index (reference.grouped._o2c; m of 0
// counts as 1).
inline int64_t O2C(int64_t l, int64_t m, int64_t k) {
  const int64_t m1 = m > 0 ? m : 1;
  return (l % m1) * k + l / m1;
}

// Canonical [m, k] index -> index in the transpose (reference.grouped._c2o; k of 0 counts as 1).
inline int64_t C2O(int64_t l, int64_t m, int64_t k) {
  const int64_t k1 = k > 0 ? k : 1;
  return (l % k1) * m + l / k1;
}

// One work unit of a grouped handler: group g (n: the buffer tail), and a unit index inside it (-1: the whole group
// on the generic path).
struct GroupUnit {
  int64_t g, u;
};

}  // namespace cpu
}  // namespace jax_fp4
