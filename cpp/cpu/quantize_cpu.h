// Per-band encoders of the CPU quantize handler (cpp/cpu/quantize_cpu.cc): one orientation of x[P, M, K] viewed as
// V[P, R, C] with the block axis last (rowwise: V = x; columnwise: V[p] = x[p].T), processed in bands of 16 rows
// of one p. The element arithmetic is that of the CUDA kernels (common/convert.cuh, common/e2m1.cuh,
// dequantize/decode.cuh, compiled for the host), in the order of jax_fp4.reference (docs/numerics.md sections 1-3).
#pragma once

#include <cstdint>

#include "quantize/options.h"

namespace jax_fp4 {
namespace cpu {

// The format kinds and NVFP4 option bits under the quantize kernels' names (quantize/options.h: Kind, kNone, kNvfp4,
// kMxfp8E4m3, kMxfp8E5m2, Option, kSr, kRht, k2d, k1x64; the host build sees nothing else of namespace quantize).
using namespace quantize;

constexpr int kBand = 16;  // oriented rows per work unit (one 2D tile high)

struct Orientation {
  int kind = kNone, opts = 0;
  bool col = false, exact = false, swizzled = false;
  int64_t P = 0, R = 0, C = 0;
  int64_t cols_padded = 0;      // swizzled scale-matrix columns
  uint8_t* data = nullptr;      // codes (NVFP4 packed, even index low nibble) or, when exact, bfloat16 values
  uint8_t* scale = nullptr;
  float* wamax = nullptr;       // NVFP4 1x64: [P, R, C/64]
  const float* amax = nullptr;  // [P]
  const uint32_t* key = nullptr;     // Philox key words k0, k1
  const uint32_t* stream = nullptr;  // null, or the shard's (p_off, r_off, c_off, P_tot, R_tot, C_tot)
};

// Encodes rows [r0, r0 + rows) of V[p] held as fp32 in buf[rows][C] (RHT not yet applied).
void EncodeBand(const Orientation& o, int64_t p, int64_t r0, int rows, float* buf);

// MXFP8 columnwise: encodes the blocks of rows [m0, m0 + 32) of x[p], held as fp32 in buf[32][K] (x's layout).
void EncodeMxfp8Stripe(const Orientation& o, int64_t p, int64_t m0, const float* buf);

// max over n input elements (x of dtype `bytes`: 2 bf16 when `bf16`, else f16; 4 f32) of |v| as fp32 bits, NaN
// counting 0 (reference/amax.py abs_bits), as an int32 (the keys are below 2^31).
int32_t AbsBitsMax(const uint8_t* x, int64_t n, int bytes, bool bf16);

}  // namespace cpu
}  // namespace jax_fp4
