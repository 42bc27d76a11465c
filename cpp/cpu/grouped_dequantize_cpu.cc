// CPU FFI handler `jf4_grouped_dequantize` (registered for platform "cpu" by jax_fp4/_src/ffi.py): the operands,
// result, attributes and checks (common/ffi_grouped_checks.h) of the CUDA handler
// (cpp/grouped/grouped_dequantize_ffi.cu; no limit on the group count), bit-exact to
// jax_fp4.reference.grouped.dequantize_groups (docs/numerics.md section 4), in parallel over work units of all groups
// (cpu/parallel.h).
//
// A group whose block axis is whole blocks and that lies inside the buffer (NVFP4: at an even offset) is a [1, R, C]
// tensor to the single-tensor decoder (cpu/dequantize_cpu.h: the code of jf4_dequantize; NVFP4 columnwise with the
// transposed output, MXFP8 columnwise with its [M_g / 32, K_g] scales), one unit per row or 32-row block. Any other
// group is one unit on the generic path: each internal block decoded from the codes and the scale slot the reference
// reads (bounded by the buffers; NVFP4 with the inverse RHT over the block, padding codes included) and its group
// elements stored. Output positions past the last group are 0.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/convert.cuh"
#include "common/errors.h"
#include "common/ffi_codes.h"
#include "common/ffi_grouped_checks.h"
#include "common/ffi_utils.h"
#include "cpu/dequantize_cpu.h"
#include "cpu/grouped_cpu.h"
#include "cpu/parallel.h"
#include "dequantize/decode.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace cpu {
namespace {

constexpr int64_t kMinWork = 1 << 18;  // elements per extra thread

struct Call {
  const uint8_t* data;
  const uint8_t* scale;
  const float* amax;  // [N] NVFP4 tensor amax, null for MXFP8 and raw
  void* out;
  int out_bytes;
  bool out_bf16;
  int kind;
  bool col, rht, raw;
  bool bound256;  // NVFP4 tensor scales on the E4M3 bound 256 (4over6)
  int64_t bs;

  bool Nvfp4() const { return kind == dequantize::kNvfp4; }
  bool Direct(const GroupTable& t, int64_t g) const {
    return t.Aligned(g, col, bs) && t.Inside(g) && (!Nvfp4() || t.off[g] % 2 == 0);
  }
};

// Group g as one tensor for the single-tensor decoder.
Geometry GroupGeometry(const GroupTable& t, const Call& c, int64_t g) {
  const int64_t off = t.off[g], m = t.rows[g], k = t.cols[g];
  Geometry d{};
  d.data = c.data + (c.Nvfp4() ? off / 2 : off);
  d.scale = c.scale + off / c.bs;
  d.amax = c.amax ? c.amax + g : nullptr;
  d.P = 1;
  const bool transposed = c.Nvfp4() && c.col;  // NVFP4 columnwise stores x_g.T
  d.R = transposed ? k : m;
  d.C = transposed ? m : k;
  d.kind = c.kind;
  d.flags = (c.Nvfp4() && c.rht && !c.raw ? codes::dequantize::kRht : 0) |
            (transposed ? codes::dequantize::kTransposeOut : 0) |
            (!c.Nvfp4() && c.col ? codes::dequantize::kMxColumnwise : 0) |
            (c.Nvfp4() && c.bound256 ? codes::dequantize::kE4m3Max256 : 0);
  d.out = static_cast<uint8_t*>(c.out) + off * c.out_bytes;
  d.out_bytes = c.out_bytes;
  d.out_bf16 = c.out_bf16;
  return d;
}

// Group g on the generic path: internal block b as the reference decodes it.
void DequantizeGeneric(const GroupTable& t, const Call& c, int64_t g) {
  const int64_t off = t.off[g], end = t.off[g + 1], cnt = end - off, m = t.rows[g], k = t.cols[g], size = t.size;
  const int64_t blocks = (cnt + c.bs - 1) / c.bs;
  for (int64_t b = 0; b < blocks; ++b) {
    if (c.Nvfp4()) {
      const int64_t si = off / 16 + b;
      const float s_b = cvt::E4M3Value(si < size / 16 ? c.scale[si] : 0u);
      const float f = c.raw ? s_b : cvt::Nvfp4DecodeScale(s_b, c.amax[g], c.bound256);
      float v[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t e = off + 16 * b + i;
        const uint32_t q = e < size ? (c.data[e >> 1] >> (4 * (e & 1))) & 0xFu : 0u;
        v[i] = cvt::Mul(dequantize::E2M1Value(q), f);
      }
      if (c.rht && !c.raw) RhtInverse16(v);
      for (int i = 0; i < 16; ++i) {
        const int64_t l = 16 * b + i, p = off + (c.col ? O2C(l, m, k) : l);
        if (l < cnt && p < end) Store(c.out, c.out_bytes, c.out_bf16, p, v[i]);
      }
    } else {
      const int64_t si = off / 32 + (c.col ? O2C(b, m / 32, k) : b);
      const float s = dequantize::E8M0Value(si < size / 32 ? c.scale[si] : 0u);
      for (int i = 0; i < 32; ++i) {
        const int64_t l = 32 * b + i, p = off + (c.col ? O2C(l, m, k) : l);
        if (l >= cnt || p >= end) continue;
        Store(c.out, c.out_bytes, c.out_bf16, p, MxValue(c.kind, c.out_bytes, c.out_bf16, c.data[p], s));
      }
    }
  }
}

void Run(const GroupTable& t, const Call& c) {
  std::vector<GroupUnit> units;
  std::vector<Geometry> geo(t.n);
  for (int64_t g = 0; g < t.n; ++g) {
    if (t.Count(g) == 0) continue;
    if (!c.Direct(t, g)) {
      units.push_back({g, -1});
      continue;
    }
    geo[g] = GroupGeometry(t, c, g);
    const int64_t nu = DequantizeUnits(geo[g]);
    for (int64_t u = 0; u < nu; ++u) units.push_back({g, u});
  }
  ParallelFor(int64_t(units.size()), t.End(), kMinWork, [&](int64_t i) {
    if (units[i].u < 0) {
      DequantizeGeneric(t, c, units[i].g);
    } else {
      DequantizeUnit(geo[units[i].g], units[i].u);
    }
  });
  for (int64_t p = t.End(); p < t.size; ++p) Store(c.out, c.out_bytes, c.out_bf16, p, 0.0f);  // past the groups
}

ffi::Error GroupedDequantizeImpl(ffi::AnyBuffer data, ffi::AnyBuffer scale, ffi::Buffer<ffi::F32> amax,
                                 ffi::Buffer<ffi::S32> first_dims, ffi::Buffer<ffi::S32> last_dims,
                                 ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> out, int32_t kind, int32_t flags) {
  checks::GroupedDequantizeCall gc;
  JF4_RETURN_IF_ERROR(checks::CheckGroupedDequantize(data, scale, amax, first_dims, last_dims, *out, kind, flags,
                                                     checks::kNoGroupLimit, &gc));
  if (gc.size == 0) return ffi::Error::Success();
  JF4_CHECK(first_dims.typed_data() != nullptr && last_dims.typed_data() != nullptr, gc.where + ": null dims");
  Call c{};
  c.data = static_cast<const uint8_t*>(data.untyped_data());
  c.scale = static_cast<const uint8_t*>(scale.untyped_data());
  c.amax = gc.tensor_scale ? amax.typed_data() : nullptr;
  c.out = out->untyped_data();
  c.out_bytes = gc.out_type == ffi::DataType::F32 ? 4 : 2;
  c.out_bf16 = gc.out_type == ffi::DataType::BF16;
  c.kind = kind;
  c.col = gc.col;
  c.rht = gc.rht;
  c.raw = gc.raw;
  c.bound256 = gc.bound256;
  c.bs = gc.bs;
  const GroupTable t(first_dims.typed_data(), last_dims.typed_data(), gc.n, gc.size);
  IeeeScope ieee;
  Run(t, c);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cpu
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(jf4_cpu_grouped_dequantize, jax_fp4::cpu::GroupedDequantizeImpl,
                              jax_fp4::checks::GroupedDequantizeSignature(xla::ffi::Ffi::Bind()));
