// CPU FFI handler `jf4_grouped_quantize` (registered for platform "cpu" by jax_fp4/_src/ffi.py): the operands, results,
// attributes and checks (common/ffi_grouped_checks.h) of the CUDA handler (cpp/grouped/grouped_quantize_ffi.cu; no
// limit on the group count, whose table the host keeps), bit-exact to jax_fp4.reference.grouped.quantize_groups
// (docs/numerics.md section 4), in parallel over work units of all groups (cpu/parallel.h).
//
// Per orientation: (1) the per-group NVFP4 tensor amaxes unless given (the max |y| over the group's internal blocks, y
// after the RHT for RHT formats); (2) the encode. A group whose block axis is whole blocks and that lies inside the
// buffer (NVFP4: at an even offset, so its codes fill whole bytes) is a [1, M_g, K_g] tensor to the single-tensor band
// encoder (cpu/quantize_cpu.h EncodeBand: the same code as jf4_quantize), one unit per 16 oriented rows. Any other
// group -- misaligned (traced sizes), after one (odd offsets), or overrunning the buffer -- is one unit on the generic
// path: its internal blocks gathered exactly as the reference gathers them (reads past the group included), encoded by
// EncodeBand as one row, then scattered to the reference's data positions and scale slots; misaligned groups poisoned
// like the reference (NaN scales, MXFP8 data and NVFP4 amax). NVFP4 bytes shared by two groups are composed after the
// parallel pass. Buffer positions past the last group hold code 0.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/convert.cuh"
#include "common/errors.h"
#include "common/ffi_codes.h"
#include "common/ffi_grouped_checks.h"
#include "common/ffi_utils.h"
#include "cpu/grouped_cpu.h"
#include "cpu/parallel.h"
#include "cpu/quantize_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace jax_fp4 {
namespace cpu {
namespace {

constexpr int64_t kMinWork = 1 << 18;     // elements per extra thread
constexpr int64_t kAmaxChunk = 1 << 14;   // elements per unit of a flat (non-RHT) amax

struct Source {
  const uint8_t* x;
  int64_t size;
  int bytes;
  bool bf16;
};

// Element i of x as fp32 (exact).
float ElementAt(const Source& s, int64_t i) {
  if (s.bytes == 4) {
    float v;
    std::memcpy(&v, s.x + 4 * i, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, s.x + 2 * i, 2);
  return Widen(h, s.bf16);
}

// Rows [r0, r0 + rows) of the oriented view of the group at `off` (rowwise x_g [m, k], columnwise x_g.T [k, m]),
// widened to fp32 into buf[rows][C]. The group lies inside the buffer.
JF4_CPU_CLONES void LoadBand(const Source& s, int64_t off, int64_t m, int64_t k, bool col, int64_t r0, int rows, float* buf) {
  if (!col) {
    WidenRun(s.x + (off + r0 * k) * s.bytes, int64_t(rows) * k, s.bytes, s.bf16, buf);
    return;
  }
  float tmp[kBand];
  for (int64_t i = 0; i < m; ++i) {
    WidenRun(s.x + (off + i * k + r0) * s.bytes, rows, s.bytes, s.bf16, tmp);
    for (int j = 0; j < rows; ++j) buf[j * m + i] = tmp[j];
  }
}

// The group's oriented elements l in [0, len) as the reference gathers them: x[off + l] (rowwise) or
// x[off + o2c(l, m, k)] (columnwise), 0 past the buffer.
void Gather(const Source& s, const GroupTable& t, int64_t g, bool col, int64_t len, float* y) {
  const int64_t off = t.off[g], m = t.rows[g], k = t.cols[g];
  for (int64_t l = 0; l < len; ++l) {
    const int64_t src = off + (col ? O2C(l, m, k) : l);
    y[l] = src < s.size ? ElementAt(s, src) : 0.0f;
  }
}

// |v| as fp32 bits with NaN -> 0 (non-negative floats order like their bits): reference/amax.py abs_bits.
inline uint32_t AbsBits(float v) {
  const uint32_t a = cvt::Bits(v) & 0x7FFFFFFFu;
  return a > 0x7F800000u ? 0u : a;
}

// Max AbsBits of n values (n a multiple of 16), after the forward RHT of each 16-chunk when `rht` (v is modified).
uint32_t MaxBits(float* v, int64_t n, bool rht) {
  uint32_t m = 0;
  for (int64_t c = 0; c < n; c += 16) {
    float (&w)[16] = *reinterpret_cast<float(*)[16]>(v + c);
    if (rht) cvt::RhtForward16(w);
    for (int i = 0; i < 16; ++i) m = std::max(m, AbsBits(w[i]));
  }
  return m;
}

// One orientation of the call.
struct Side {
  int kind = kNone, opts = 0;
  bool col = false;
  int64_t bs = 16;
  uint8_t* data = nullptr;
  uint8_t* scale = nullptr;
  float* amax_out = nullptr;      // [N] NVFP4
  const uint32_t* key = nullptr;  // [N, 2] Philox key words
  const float* given = nullptr;   // [N] given NVFP4 amaxes, or null
  float* enc = nullptr;           // [N] the amaxes the encode uses (scratch)
  std::vector<uint8_t> first, last;  // NVFP4 generic groups: codes of their first and last element

  bool Nvfp4() const { return kind == kNvfp4; }
  // Rows of the group's oriented view, and its length along the block axis.
  int64_t R(const GroupTable& t, int64_t g) const { return col ? t.cols[g] : t.rows[g]; }
  int64_t C(const GroupTable& t, int64_t g) const { return col ? t.rows[g] : t.cols[g]; }
  // The band path: whole blocks, inside the buffer, NVFP4 codes starting on a byte.
  bool Direct(const GroupTable& t, int64_t g) const {
    return t.Aligned(g, col, bs) && t.Inside(g) && (!Nvfp4() || t.off[g] % 2 == 0);
  }
};

// A group whose amax is max |x_g| in both orientations (no RHT, whole 16-blocks both ways, inside the buffer).
bool PlainAmax(const GroupTable& t, const Side& side, int64_t g) {
  return !(side.opts & kRht) && t.Aligned(g, false, 16) && t.Aligned(g, true, 16) && t.Inside(g);
}

// Per-group NVFP4 amaxes (reference.grouped._nvfp4_blocks: segment max of the block amaxes) into side.enc. `other`:
// the other orientation's side when its amaxes were computed (not given) and it is NVFP4 without RHT too, so the groups
// where both are max |x_g| (PlainAmax) copy them instead of reading x again.
void ComputeAmax(const Source& s, const GroupTable& t, Side& side, const Side* other) {
  const bool rht = side.opts & kRht;
  const auto reuse = [&](int64_t g) { return other != nullptr && PlainAmax(t, side, g) && PlainAmax(t, *other, g); };
  std::vector<GroupUnit> units;
  for (int64_t g = 0; g < t.n; ++g) {
    const int64_t cnt = t.Count(g);
    if (cnt == 0 || reuse(g)) continue;
    if (!t.Aligned(g, side.col, 16) || !t.Inside(g)) {
      units.push_back({g, -1});
    } else {
      const int64_t nu = rht ? (side.R(t, g) + kBand - 1) / kBand : (cnt + kAmaxChunk - 1) / kAmaxChunk;
      for (int64_t u = 0; u < nu; ++u) units.push_back({g, u});
    }
  }
  std::vector<uint32_t> part(units.size(), 0u);
  ParallelFor(int64_t(units.size()), t.End(), kMinWork, [&](int64_t i) {
    const int64_t g = units[i].g, u = units[i].u, off = t.off[g];
    std::vector<float> buf;
    if (u < 0) {  // the reference's blocks of the group, padding reads included
      buf.resize((t.Count(g) + 15) / 16 * 16);
      Gather(s, t, g, side.col, int64_t(buf.size()), buf.data());
      part[i] = MaxBits(buf.data(), int64_t(buf.size()), rht);
    } else if (rht) {  // 16 rows of the oriented view, transformed along them
      const int64_t r0 = u * kBand, C = side.C(t, g);
      const int rows = int(std::min<int64_t>(kBand, side.R(t, g) - r0));
      buf.resize(size_t(rows) * C);
      LoadBand(s, off, t.rows[g], t.cols[g], side.col, r0, rows, buf.data());
      part[i] = MaxBits(buf.data(), int64_t(buf.size()), true);
    } else {  // a max is order-free: a flat chunk of the group
      const int64_t b = u * kAmaxChunk, e = std::min(t.Count(g), b + kAmaxChunk);
      part[i] = uint32_t(AbsBitsMax(s.x + (off + b) * s.bytes, e - b, s.bytes, s.bf16));
    }
  });
  std::vector<uint32_t> bits(t.n, 0u);
  for (size_t i = 0; i < units.size(); ++i) bits[units[i].g] = std::max(bits[units[i].g], part[i]);
  for (int64_t g = 0; g < t.n; ++g) side.enc[g] = reuse(g) ? other->enc[g] : cvt::Float(bits[g]);
}

// The single-tensor description of group g (a [1, M_g, K_g] tensor) for EncodeBand.
Orientation GroupOrientation(const GroupTable& t, const Side& side, int64_t g) {
  Orientation o;
  o.kind = side.kind, o.opts = side.opts, o.col = side.col;
  o.P = 1, o.R = side.R(t, g), o.C = side.C(t, g);
  o.data = side.data + (side.Nvfp4() ? t.off[g] / 2 : t.off[g]);
  o.scale = side.scale + t.off[g] / side.bs;
  o.amax = side.enc + g;
  o.key = side.key + 2 * g;
  return o;
}

// Group g on the generic path (module comment).
void EncodeGeneric(const Source& s, const GroupTable& t, Side& side, int64_t g) {
  const int64_t off = t.off[g], end = t.off[g + 1], cnt = end - off, bs = side.bs, m = t.rows[g], k = t.cols[g];
  const bool aligned = t.Aligned(g, side.col, bs);
  if (!side.Nvfp4() && !aligned) {  // poisoned: NaN data and scales
    std::memset(side.data + off, 0x7F, size_t(cnt));
    for (int64_t q = off / bs; q < end / bs; ++q) side.scale[q] = 0xFF;
    return;
  }
  const int64_t len = (cnt + bs - 1) / bs * bs;
  std::vector<float> y(len);
  Gather(s, t, g, side.col, len, y.data());
  std::vector<uint8_t> codes(side.Nvfp4() ? len / 2 : len), scales(len / bs);
  Orientation o;  // the internal blocks as one row
  o.kind = side.kind, o.opts = side.opts;
  o.P = 1, o.R = 1, o.C = len;
  o.data = codes.data(), o.scale = scales.data();
  o.amax = side.enc + g;
  o.key = side.key + 2 * g;
  EncodeBand(o, 0, 0, 1, y.data());
  if (side.Nvfp4()) {  // stored in the oriented order: element off + l is internal element l
    const auto code = [&](int64_t l) { return uint8_t((codes[l >> 1] >> (4 * (l & 1))) & 0xFu); };
    for (int64_t p = off + (off & 1); p + 1 < end; p += 2) {
      side.data[p >> 1] = uint8_t(code(p - off) | (code(p + 1 - off) << 4));
    }
    side.first[g] = code(0), side.last[g] = code(cnt - 1);
    for (int64_t q = off / 16; q < end / 16; ++q) side.scale[q] = aligned ? scales[q - off / 16] : uint8_t(0x7F);
    return;
  }
  // MXFP8 (an aligned group overrunning the buffer): data and scales keep the canonical [M_g, K_g] order
  for (int64_t l = 0; l < cnt; ++l) {
    const int64_t i = side.col ? C2O(l, m, k) : l;
    side.data[off + l] = i < len ? codes[i] : uint8_t(0);
  }
  for (int64_t q = off / bs; q < end / bs; ++q) {
    const int64_t l = q - off / bs, i = side.col ? C2O(l, m / bs, k) : l;
    side.scale[q] = i < len / bs ? scales[i] : uint8_t(0);
  }
}

// Quantizes one orientation; `other`: the other side when it is quantized first (its amaxes are then known).
void Quantize(const Source& s, const GroupTable& t, Side& side, const Side* other) {
  if (side.kind == kNone) return;
  const int64_t n = t.n;
  if (side.Nvfp4()) {
    if (side.given) {
      std::copy(side.given, side.given + n, side.enc);
    } else {
      const bool plain = other != nullptr && other->Nvfp4() && other->given == nullptr && !(other->opts & kRht);
      ComputeAmax(s, t, side, plain ? other : nullptr);
    }
    const float nan = cvt::Float(0x7FC00000u);  // a misaligned group's amax
    for (int64_t g = 0; g < n; ++g) side.amax_out[g] = t.Aligned(g, side.col, 16) ? side.enc[g] : nan;
    side.first.assign(n, 0), side.last.assign(n, 0);
  }
  // MXFP8 columnwise: a unit is a 32-row stripe of x_g, encoded in x's layout (EncodeMxfp8Stripe, as jf4_quantize);
  // otherwise 16 rows of the oriented view (EncodeBand).
  const bool stripes = side.col && !side.Nvfp4();
  std::vector<GroupUnit> units;
  for (int64_t g = 0; g < n; ++g) {
    if (t.Count(g) == 0) continue;
    if (!side.Direct(t, g)) {
      units.push_back({g, -1});
      continue;
    }
    const int64_t nu = stripes ? t.rows[g] / 32 : (side.R(t, g) + kBand - 1) / kBand;
    for (int64_t u = 0; u < nu; ++u) units.push_back({g, u});
  }
  ParallelFor(int64_t(units.size()), t.End(), kMinWork, [&](int64_t i) {
    const int64_t g = units[i].g, u = units[i].u;
    if (u < 0) {
      EncodeGeneric(s, t, side, g);
      return;
    }
    const Orientation o = GroupOrientation(t, side, g);
    if (stripes) {
      std::vector<float> buf(size_t(32) * t.cols[g]);
      LoadBand(s, t.off[g], t.rows[g], t.cols[g], false, 32 * u, 32, buf.data());
      EncodeMxfp8Stripe(o, 0, 32 * u, buf.data());
      return;
    }
    const int64_t r0 = u * kBand;
    const int rows = int(std::min<int64_t>(kBand, o.R - r0));
    std::vector<float> buf(size_t(rows) * o.C);
    LoadBand(s, t.off[g], t.rows[g], t.cols[g], side.col, r0, rows, buf.data());
    EncodeBand(o, 0, r0, rows, buf.data());
  });
  // NVFP4 bytes holding the last element of a group at an odd end: its low nibble, and the first element of the next
  // non-empty group (which starts there, at an odd offset, so on the generic path) or 0 past the groups.
  const int64_t end = t.End();
  if (side.Nvfp4()) {
    for (int64_t g = 0; g < n; ++g) {
      const int64_t e = t.off[g + 1];
      if (t.Count(g) == 0 || e % 2 == 0) continue;
      uint8_t hi = 0;
      for (int64_t h = g + 1; h < n && e < end; ++h) {
        if (t.Count(h) > 0) {
          hi = side.first[h];
          break;
        }
      }
      side.data[e >> 1] = uint8_t(side.last[g] | (hi << 4));
    }
  }
  // The tail: data bytes whose first element lies past the groups, and the scale slots past them.
  const int64_t d0 = side.Nvfp4() ? (end + 1) / 2 : end, d1 = side.Nvfp4() ? (t.size + 1) / 2 : t.size;
  if (d1 > d0) std::memset(side.data + d0, 0, size_t(d1 - d0));
  const int64_t s0 = end / side.bs, s1 = t.size / side.bs;
  if (s1 > s0) std::memset(side.scale + s0, 0, size_t(s1 - s0));
}

// One orientation of a checked call (common/ffi_grouped_checks.h).
Side MakeSide(const checks::GroupedResults& r, bool col) {
  Side side;
  side.kind = r.kind, side.opts = r.opts, side.col = col;
  if (r.kind != kNone) side.bs = checks::BlockSize(r.kind);
  side.data = r.data, side.scale = r.scale, side.amax_out = r.amax;
  return side;
}

ffi::Error GroupedQuantizeImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> first_dims, ffi::Buffer<ffi::S32> last_dims,
                               ffi::Buffer<ffi::U32> key_row, ffi::Buffer<ffi::U32> key_col,
                               ffi::Buffer<ffi::F32> amax_in, ffi::RemainingArgs,
                               ffi::Result<ffi::AnyBuffer> row_data, ffi::Result<ffi::AnyBuffer> row_scale,
                               ffi::Result<ffi::AnyBuffer> row_amax, ffi::Result<ffi::AnyBuffer> col_data,
                               ffi::Result<ffi::AnyBuffer> col_scale, ffi::Result<ffi::AnyBuffer> col_amax,
                               ffi::Result<ffi::Buffer<ffi::F32>> scratch, int32_t row_kind, int32_t col_kind,
                               int32_t flags, int32_t amax_given) {
  const auto xt = x.element_type();
  JF4_CHECK(xt == ffi::DataType::BF16 || xt == ffi::DataType::F16 || xt == ffi::DataType::F32,
            checks::GroupedWhere("jf4_grouped_quantize: x", static_cast<int64_t>(ElementCount(x)),
                                 static_cast<int64_t>(ElementCount(first_dims))) +
                ": unsupported dtype " + DataTypeName(xt) + " (expected bfloat16, float16 or float32)");
  checks::GroupedQuantizeCall c;
  JF4_RETURN_IF_ERROR(checks::CheckGroupedQuantize(x, first_dims, last_dims, key_row, key_col, amax_in, *row_data,
                                                   *row_scale, *row_amax, *col_data, *col_scale, *col_amax, *scratch,
                                                   row_kind, col_kind, flags, amax_given, checks::kNoGroupLimit, &c));
  const int64_t size = c.size, n = c.n;
  Side row = MakeSide(c.row, false), col = MakeSide(c.col, true);

  // The scratch holds the amaxes each NVFP4 orientation encodes with (given or computed), then a zero word (the CUDA
  // kernel's scheduling counter).
  float* sc = scratch->typed_data();
  std::fill(sc, sc + ElementCount(*scratch), 0.0f);
  row.key = key_row.typed_data(), col.key = key_col.typed_data();
  row.enc = sc, col.enc = sc + n;
  if (row.Nvfp4() && (amax_given & 1)) row.given = amax_in.typed_data();
  if (col.Nvfp4() && (amax_given & 2)) col.given = amax_in.typed_data() + n;

  const GroupTable t(first_dims.typed_data(), last_dims.typed_data(), n, size);
  const Source s{static_cast<const uint8_t*>(x.untyped_data()), size, xt == ffi::DataType::F32 ? 4 : 2,
                 xt == ffi::DataType::BF16};
  IeeeScope ieee;  // the serial parts (the per-group amax reduction) see subnormals too
  Quantize(s, t, row, nullptr);
  Quantize(s, t, col, &row);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cpu
}  // namespace jax_fp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(jf4_cpu_grouped_quantize, jax_fp4::cpu::GroupedQuantizeImpl,
                              jax_fp4::checks::GroupedQuantizeSignature(xla::ffi::Ffi::Bind()));
