// The decoders of the CPU dequantize handler (cpp/cpu/dequantize_cpu.cc), shared with the grouped handlers
// (cpp/cpu/grouped_dequantize_cpu.cc): one tensor's codes + scales viewed as data[P, R, C] decoded in independent work
// units (rows, or 32-row blocks for MXFP8 columnwise), and the output stores with the reference's rounding.
#pragma once

#include <cstdint>

namespace jax_fp4 {
namespace cpu {

// One tensor to decode. flags: the jf4_dequantize flags (common/ffi_codes.h); kBlockOnly is expressed by a null
// amax (NVFP4 without 1x64: value(q) * s_b).
struct Geometry {
  const uint8_t* data;   // codes (NVFP4 packed two per byte, even index in the low nibble)
  const uint8_t* scale;  // compact [P * R, C / block] (MXFP8 columnwise: [P, R / 32, C]) or swizzled
  const float* amax;     // tensor amax, null for block-only / 1x64 / MXFP8
  bool amax_per_p;
  const float* wamax;
  int64_t P, R, C, cols_padded;
  int kind, flags;
  void* out;             // [P, R, C], or [P, C, R] with kTransposeOut
  int out_bytes;         // 4: float32, 2: bfloat16 (out_bf16) or float16
  bool out_bf16;
};

// Output element i of fp32 v: float32 with canonical NaN, bfloat16 / float16 RNE with canonical NaN.
void Store(void* out, int bytes, bool bf16, int64_t i, float v);
// MXFP8 element (code, E8M0 value s) for an output of out_bytes / out_bf16, saturated as dequantize::MxDecode.
float MxValue(int kind, int out_bytes, bool out_bf16, uint32_t code, float s);
// Inverse RHT of one 16-chunk (reference/rht.py inverse).
void RhtInverse16(float (&v)[16]);
// fp32 values of row r of data[p] (NVFP4, or MXFP8 with blocks along C) into v[C].
void DequantizeRow(const Geometry& g, int64_t p, int64_t r, float* v);
// Work units of g (each writes only its own outputs) and unit u's decode into g.out.
int64_t DequantizeUnits(const Geometry& g);
void DequantizeUnit(const Geometry& g, int64_t u);

}  // namespace cpu
}  // namespace jax_fp4
