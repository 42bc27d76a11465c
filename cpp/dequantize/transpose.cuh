// NVFP4 dequantize with kTransposeOut (the block axis is not x's last axis): out[p] = stored[p].T, [C, R], for the
// 1D / 2D, RHT and 1x64 variants, to f32 / bf16 / f16, compact or swizzled scales (docs/numerics.md sections 1-3).
//
// A 256-thread block owns a tile of kTR = 128 stored rows x kTC = 64 stored columns. Thread t decodes segment
// cg = t % 4 (columns 16 * cg ...) of the stored rows 2j and 2j + 1, j = t / 4: a warp's 8-byte loads cover 8 whole
// 32-byte row pieces. Both rows' values at one column form one output pair (two 16-bit outputs packed by one
// cvt.rn.{bf16,f16}x2.f32, or two floats), stored to shared memory at pair slot j ^ (8 * cg) of tile row
// 16 * cg + i: the XOR spreads the four segments over the banks and keeps 16-byte groups contiguous. The block then
// writes the kTC output rows of kTR elements as 16-byte runs, consecutive threads on consecutive runs (whole tiles
// with evict-first stores, st.global.cs: 0-3 % faster on an H100 than default stores, more for f32 outputs).
// The decode is specialised per variant (kTransposePlain / kTransposeRht / kTransposeLocal), so the common 1D case
// carries no RHT or division code. Values that cannot produce NaN (finite multiplier; for RHT |multiplier| <= 2^100,
// so 16-term sums stay finite) skip the canonical-NaN fix-up of OutBits. 16-bit outputs of finite plain multipliers
// and of 1x64 segments in a safe window look their values up in a per-segment table (half_table.cuh); 16-bit RHT
// outputs of multipliers in [2^-100, 2^100] skip the flushes and the final * +-0.25 (RhtScaleFree in args.cuh) and
// decode their codes through fp16 (E2M1x8Half, the 2^14 folded into the multiplier); they transform one stored row
// at a time and pair the rows' packed outputs by byte permutes (40 registers: 6 blocks an SM without spills).
// Grid (TileGridPerTile): blocks take the tiles in band order. 16-bit outputs run one block per tile, 6 blocks an SM;
// f32 1x64 outputs two tiles a block, loading the second tile's codes and scales before decoding the first; f32
// plain / RHT outputs one block per tile, 4 blocks an SM. No atomics, no scratch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/convert.cuh"
#include "common/scale_layout.cuh"
#include "dequantize/args.cuh"
#include "dequantize/decode.cuh"
#include "dequantize/half_table.cuh"

namespace jax_fp4 {
namespace dequantize {

constexpr int kTR = 128, kTC = 64;
// Resident blocks per SM (__launch_bounds__: at most 64 registers) and column tiles per band (TilePos): 4 blocks beat
// 5 by 1-3 %, bands of 32 beat column-tile-first order by up to 20 % (docs/kernels/dequantize.md).
constexpr int kTransposeBlocksPerSm = 4, kMaxBand = 32;
constexpr int kTransposeBlocksPerSm16 = 6;  // one-tile blocks with 16-bit outputs (TransposeBlocksPerSm)
constexpr int kTilesPerBlock = 2;           // 1x64 with f32 outputs (TileGridPerTile)
enum TransposeVariant : int { kTransposePlain = 0, kTransposeRht = 1, kTransposeLocal = 2 };

// Grid shape per variant and output width: one block per tile, or kTilesPerBlock tiles a block with the next tile's
// loads issued before the current tile's decode, whichever measured faster (docs/kernels/dequantize.md): one-tile
// blocks beat a persistent grid; 16-bit outputs run one tile a block at 6 blocks an SM without the load-ahead (the
// RHT variant since it transforms one row at a time, StoreRhtPairs: 40 registers instead of 64); f32 outputs keep 4
// blocks (their tiles take twice the shared memory) and load ahead.
template <typename Out, int kVar>
constexpr bool TileGridPerTile() {
  return sizeof(Out) == 2 || kVar != kTransposeLocal;
}

// The kernel loads the next tile ahead: multi-tile blocks, and the f32 one-tile kernels (measured faster).
template <typename Out, int kVar>
constexpr bool TransposeLoadAhead() {
  return !TileGridPerTile<Out, kVar>() || sizeof(Out) == 4;
}

template <typename Out, int kVar>
constexpr int TransposeBlocksPerSm() {
  return sizeof(Out) == 2 && TileGridPerTile<Out, kVar>() ? kTransposeBlocksPerSm16 : kTransposeBlocksPerSm;
}

template <typename Out>
using PairOf = typename std::conditional<sizeof(Out) == 4, uint2, uint32_t>::type;  // one output pair's bits

// Output bits of (lo, hi) as one pair; kFinite: neither is NaN (paired RNE conversion, no NaN fix-up).
template <typename Out, bool kFinite>
__device__ __forceinline__ PairOf<Out> PackPair(float lo, float hi) {
  if constexpr (sizeof(Out) == 4) {
    return kFinite ? make_uint2(__float_as_uint(lo), __float_as_uint(hi))
                   : make_uint2(OutBits<float>(lo), OutBits<float>(hi));
  } else if constexpr (!kFinite) {
    return OutBits<Out>(lo) | (OutBits<Out>(hi) << 16);
  } else {
    return FinitePair16<Out>(lo, hi);
  }
}

// One stored row's segment: its 16 codes and what turns a code value into the output value.
struct SegmentScale {
  uint2 codes = make_uint2(0u, 0u);
  float mult = 0.0f;  // plain / RHT: s_b * amax / 2688 (or s_b alone); 1x64: s_b
  float enc = 1.0f;   // 1x64: the window's S_enc
};

// What a thread loads for one tile (its two segments), issued one tile ahead of its use.
struct RawSegments {
  uint2 codes[2] = {make_uint2(0u, 0u), make_uint2(0u, 0u)};
  uint32_t scale[2] = {0u, 0u};      // E4M3 codes (0 = +0 past the tensor: those rows decode as zeros)
  float window[2] = {0.0f, 0.0f};    // 1x64: window amax
  float amax = 0.0f;                 // plain / RHT, one tensor amax per p: the tensor amax of p
};

// Position of a tile in band order: p, column band (g column tiles: concurrently running blocks cover g column tiles
// of consecutive row tiles, so both the stored rows they read and the output rows they write are long runs), row
// tile, column tile within the band (fastest), advanced by the grid size in mixed radix. The launcher pads the
// column tiles to whole bands; a padding tile (ct >= col_tiles) loads nothing, decodes zeros and stores nothing
// (skipping it with a branch measured 7 % slower for RHT / 1x64 on an H100: the loop's schedule changed). 32-bit:
// the launcher keeps the padded tile count below 2^31.
struct TilePos {
  int p, band, rt, cin, ct;
  __device__ __forceinline__ static TilePos Of(int k, int row_tiles, int bands, int g) {
    const int rest = k / g, rest2 = rest / row_tiles;
    const int band = rest2 % bands, cin = k % g;
    return TilePos{rest2 / bands, band, rest % row_tiles, cin, band * g + cin};
  }
  __device__ __forceinline__ void Advance(const TilePos& by, int row_tiles, int bands, int g) {
    cin += by.cin;
    const bool c0 = cin >= g;
    if (c0) cin -= g;
    rt += by.rt + c0;
    const bool c1 = rt >= row_tiles;
    if (c1) rt -= row_tiles;
    band += by.band + c1;
    const bool c2 = band >= bands;
    if (c2) band -= bands;
    p += by.p + c2;
    ct = band * g + cin;
  }
};

// The thread-constant parts of its two segments' offsets (tile row 2j + r, columns 16 cg ..): the per-tile parts
// are uniform across the block, so a tile costs a few additions per load instead of 64-bit index products.
struct ThreadOffsets {
  int64_t data;    // bytes: (2j * C + 16 cg) / 2 (row 2j + 1: + C / 2)
  int64_t scale;   // compact scale: 2j * (C / 16) + cg (+ C / 16)
  int64_t window;  // 1x64 window amax: 2j * (C / 64) (+ C / 64)
  int swz[2];      // swizzled scale inside a 512-byte tile (tiles aligned with the 128 rows: R % 128 == 0)
  __device__ __forceinline__ ThreadOffsets(const Args& a, int j, int cg)
      : data(j * a.C + cg * (kSeg / 2)), scale(2 * j * (a.C >> 4) + cg), window(2 * j * (a.C >> 6)) {
#pragma unroll
    for (int r = 0; r < 2; ++r) swz[r] = ((2 * j + r) & 31) * 16 + ((2 * j + r) >> 5) * 4 + cg;
  }
};

// The tensor amax that scales p's block scales (plain / RHT with a tensor scale; 1x64 and block-only: unused).
template <int kVar>
__device__ __forceinline__ float TensorAmax(const Args& a, int p) {
  if (kVar == kTransposeLocal || (a.flags & kBlockOnly)) return 0.0f;
  return __ldg(a.amax + (a.amax_per_p ? p : 0));
}

template <int kVar>
__device__ __forceinline__ RawSegments LoadRaw(const Args& a, const TilePos& pos, const ThreadOffsets& off, int j,
                                               int cg) {
  RawSegments raw;
  if (a.amax_per_p) raw.amax = TensorAmax<kVar>(a, pos.p);
  // Block-uniform: the tile's first stored row (of all P * R) and column; C % 16 == 0, so segments are whole and
  // row0 * C + c0 is even.
  const int64_t C = a.C, r0 = int64_t(pos.rt) * kTR, c0 = int64_t(pos.ct) * kTC, row0 = pos.p * a.R + r0;
  if (c0 + cg * kSeg >= C) return raw;
  const bool row_in[2] = {r0 + 2 * j < a.R, r0 + 2 * j + 1 < a.R};
  const uint8_t* const src = a.data + ((row0 * C + c0) >> 1) + off.data;
  if (a.vector_data) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (row_in[r]) raw.codes[r] = __ldg(reinterpret_cast<const uint2*>(src + r * (C >> 1)));
    }
  } else {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (!row_in[r]) continue;
        (i < 4 ? raw.codes[r].x : raw.codes[r].y) |= uint32_t(__ldg(src + r * (C >> 1) + i)) << (8 * (i & 3));
      }
    }
  }
  const uint8_t* scale;
  int64_t scale_step = C >> 4;  // row 2j + 1's scale, from row 2j's
  if (!(a.flags & kSwizzled)) {
    scale = a.scale + row0 * (C >> 4) + (c0 >> 4) + off.scale;
  } else if (a.R % kTR == 0) {  // c0 / 16 is a multiple of 4: the 4 segments share one 128x4 scale tile
    scale = a.scale + ((row0 >> 7) * (a.scale_cols_padded >> 2) + (c0 >> 6)) * layout::kTileBytes + off.swz[0];
    scale_step = off.swz[1] - off.swz[0];
  } else {
    scale = a.scale + layout::SwizzledIndex(row0 + 2 * j, (c0 >> 4) + cg, a.scale_cols_padded);
    scale_step = layout::SwizzledIndex(row0 + 2 * j + 1, (c0 >> 4) + cg, a.scale_cols_padded) -
                 layout::SwizzledIndex(row0 + 2 * j, (c0 >> 4) + cg, a.scale_cols_padded);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row_in[r]) raw.scale[r] = __ldg(scale + r * scale_step);
  }
  if constexpr (kVar == kTransposeLocal) {
    const float* window = a.window_amax + row0 * (C >> 6) + (c0 >> 6) + off.window;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (row_in[r]) raw.window[r] = __ldg(window + r * (C >> 6));
    }
  }
  return raw;
}

template <int kVar>
__device__ __forceinline__ SegmentScale ScaleOf(const Args& a, const RawSegments& raw, float amax, int r) {
  SegmentScale s;
  s.codes = raw.codes[r];
  const float sb = cvt::E4M3Value(raw.scale[r]);
  if constexpr (kVar == kTransposeLocal) {
    s.mult = sb;
    s.enc = cvt::WindowEncodeScale(raw.window[r]);
  } else {
    s.mult = (a.flags & kBlockOnly) ? sb : cvt::Nvfp4DecodeScale(sb, amax, a.flags & kBound256);
  }
  return s;
}

template <int kVar>
__device__ __forceinline__ bool FastSegment(const SegmentScale& s) {
  if constexpr (kVar == kTransposeLocal) return isfinite(s.mult) && WindowDivisor::Safe(s.enc);
  if constexpr (kVar == kTransposeRht) return fabsf(s.mult) <= 0x1p100f;
  return isfinite(s.mult);
}

// Plain / 1x64: decode four codes at a time of both rows and store the 16 pairs (dst: stride kTR / 2 pairs).
template <typename Out, int kVar, bool kFast>
__device__ __forceinline__ void StorePairs(const SegmentScale (&s)[2], PairOf<Out>* dst) {
  [[maybe_unused]] const WindowDivisor div0 = WindowDivisor::Of(kVar == kTransposeLocal && kFast ? s[0].enc : 1.0f);
  [[maybe_unused]] const WindowDivisor div1 = WindowDivisor::Of(kVar == kTransposeLocal && kFast ? s[1].enc : 1.0f);
#pragma unroll
  for (int h = 0; h < 4; ++h) {
    float q[2][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) E2M1xN<4>((h < 2 ? s[r].codes.x : s[r].codes.y) >> (16 * (h & 1)), q[r]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float v0 = __fmul_rn(q[0][i], s[0].mult), v1 = __fmul_rn(q[1][i], s[1].mult);
      if constexpr (kVar == kTransposeLocal) {
        if constexpr (kFast) {
          v0 = div0.Div(v0), v1 = div1.Div(v1);
        } else {
          v0 = __fdiv_rn(v0, s[0].enc), v1 = __fdiv_rn(v1, s[1].enc);
        }
      }
      dst[(4 * h + i) * (kTR / 2)] = PackPair<Out, kFast>(v0, v1);
    }
  }
}

// 16-bit outputs with finite multipliers (plain variant; 1x64 with a safe window): both rows' 16 codes through their
// tables (half_table.cuh), paired per column.
template <typename Out>
__device__ __forceinline__ void StoreTablePairs(const HalfTable (&tab)[2], const SegmentScale (&s)[2],
                                                PairOf<Out>* dst) {
#pragma unroll
  for (int w = 0; w < 2; ++w) {  // code word: codes 8w .. 8w + 7 of each row
    const HalfBytes b[2] = {LookUp8(tab[0], w ? s[0].codes.y : s[0].codes.x),
                            LookUp8(tab[1], w ? s[1].codes.y : s[1].codes.x)};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // codes 4k + 2 half, + 1: the two rows' bytes interleaved
        const uint32_t sel = half ? 0x7362u : 0x5140u;
        const uint32_t x = __byte_perm(b[0].lo[k], b[1].lo[k], sel), y = __byte_perm(b[0].hi[k], b[1].hi[k], sel);
        const int c = 8 * w + 4 * k + 2 * half;
        dst[c * (kTR / 2)] = __byte_perm(x, y, 0x5140u);
        dst[(c + 1) * (kTR / 2)] = __byte_perm(x, y, 0x7362u);
      }
    }
  }
}

// Plain variant: the tables of the two rows' multipliers.
template <typename Out>
__device__ __forceinline__ void StoreTablePairs(const SegmentScale (&s)[2], PairOf<Out>* dst) {
  const HalfTable tab[2] = {MakeHalfTable<Out>(s[0].mult), MakeHalfTable<Out>(s[1].mult)};
  StoreTablePairs<Out>(tab, s, dst);
}

// 1x64 with safe windows and finite block scales (s.mult = s_b, s.enc = the window's S_enc).
template <typename Out>
__device__ __forceinline__ void StoreLocalTablePairs(const SegmentScale (&s)[2], PairOf<Out>* dst) {
  const HalfTable tab[2] = {MakeLocalHalfTable<Out>(s[0].mult, WindowDivisor::Of(s[0].enc)),
                            MakeLocalHalfTable<Out>(s[1].mult, WindowDivisor::Of(s[1].enc))};
  StoreTablePairs<Out>(tab, s, dst);
}

// The values of one stored row segment's 16 codes (q[h]: codes 8h .. 8h + 7).
__device__ __forceinline__ void E2M1x16(uint2 codes, float (&q)[2][8]) {
  E2M1xN<8>(codes.x, q[0]);
  E2M1xN<8>(codes.y, q[1]);
}

// RHT, 16-bit outputs: one stored row's 16 outputs as 8 words, w[k] = (column 2k, column 2k + 1), so that only
// 16 floats are live at a time. A RhtScaleFree multiplier (args.cuh) takes the butterfly of RN(q * m / 4), the
// codes decoded through fp16 (the 2^14 folded into the multiplier), the negated outputs' sign bits flipped in the
// packed words; any other takes RhtInverse16 (fast: no NaN, paired conversions).
template <typename Out>
__device__ __forceinline__ void RhtRowWords(const SegmentScale& s, bool fast, uint32_t (&w)[8]) {
  float v[16];
  float q[2][8];
  if (fast && RhtScaleFree(s.mult)) {
    E2M1x8Half(s.codes.x, q[0]);
    E2M1x8Half(s.codes.y, q[1]);
    const float m = __fmul_rn(s.mult, 0x1p12f);  // (m / 4) * 2^14, exact: |m| <= 2^100
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = __fmul_rn(q[i >> 3][i & 7], m);
    RhtButterfly16(v);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      constexpr uint32_t kFlip[4] = {0u, 0x8000u, 0x80000000u, 0x80008000u};
      w[k] = FinitePair16<Out>(v[2 * k], v[2 * k + 1]) ^ kFlip[(kRhtSignMask >> (2 * k)) & 3u];
    }
    return;
  }
  E2M1x16(s.codes, q);
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = __fmul_rn(q[i >> 3][i & 7], s.mult);
  RhtInverse16(v);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    w[k] = fast ? FinitePair16<Out>(v[2 * k], v[2 * k + 1])
                : OutBits<Out>(v[2 * k]) | (OutBits<Out>(v[2 * k + 1]) << 16);
  }
}

// RHT: both rows' 16 values through the inverse transform, then the 16 pairs (16-bit outputs: one row's words at a
// time, the pairs formed by byte permutes).
template <typename Out>
__device__ __forceinline__ void StoreRhtPairs(const SegmentScale (&s)[2], bool fast, PairOf<Out>* dst) {
  if constexpr (sizeof(Out) == 2) {
    uint32_t w[2][8];
    RhtRowWords<Out>(s[0], fast, w[0]);
    RhtRowWords<Out>(s[1], fast, w[1]);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      dst[2 * k * (kTR / 2)] = __byte_perm(w[0][k], w[1][k], 0x5410u);
      dst[(2 * k + 1) * (kTR / 2)] = __byte_perm(w[0][k], w[1][k], 0x7632u);
    }
  } else {
    float v[2][16];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float q[2][8];
      E2M1x16(s[r].codes, q);
#pragma unroll
      for (int i = 0; i < 16; ++i) v[r][i] = __fmul_rn(q[i >> 3][i & 7], s[r].mult);
      RhtInverse16(v[r]);
    }
    if (fast) {
#pragma unroll
      for (int i = 0; i < 16; ++i) dst[i * (kTR / 2)] = PackPair<Out, true>(v[0][i], v[1][i]);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) dst[i * (kTR / 2)] = PackPair<Out, false>(v[0][i], v[1][i]);
    }
  }
}

// Block b takes the tiles b, b + grid, b + 2 * grid, ... of the band order (TilePos), so the blocks at work at any
// moment cover neighbouring tiles, and loads each tile's codes and scales while it decodes and writes out the
// previous one. g: column tiles per band.
template <typename Out, int kVar>
__global__ void __launch_bounds__(kThreads, TransposeBlocksPerSm<Out, kVar>())
    TransposeKernel(const Args a, int row_tiles, int col_tiles, int g) {
  const int bands = (col_tiles + g - 1) / g;
  using Bits = typename std::conditional<sizeof(Out) == 4, uint32_t, uint16_t>::type;
  using Pair = PairOf<Out>;
  constexpr int kV = 16 / int(sizeof(Out));  // elements per 16-byte run
  constexpr int kPairs = kTR / 2, kRunsPerRow = kTR / kV, kRowsPerPass = kThreads / kRunsPerRow;
  constexpr int kPairsPerRun = kV / 2;
  __shared__ __align__(16) Pair tile[kTC * kPairs];
  const int t = threadIdx.x, j = t >> 2, cg = t & 3;
  const int64_t R = a.R, C = a.C;
  const int tiles = int(a.P) * row_tiles * bands * g;  // padded to whole bands
  const int mine_off = cg * kSeg * kPairs + (j ^ (cg << 3));
  const int orl0 = t / kRunsPerRow, run0 = t % kRunsPerRow;
  const TilePos stride = TilePos::Of(gridDim.x, row_tiles, bands, g);
  TilePos pos = TilePos::Of(blockIdx.x, row_tiles, bands, g);
  const ThreadOffsets off(a, j, cg);
  const float shared_amax = a.amax_per_p ? 0.0f : TensorAmax<kVar>(a, 0);  // one tensor amax for all of p
  RawSegments raw = LoadRaw<kVar>(a, pos, off, j, cg);
  for (int k = blockIdx.x; k < tiles; k += gridDim.x) {
    TilePos next = pos;
    next.Advance(stride, row_tiles, bands, g);
    constexpr bool kAhead = TransposeLoadAhead<Out, kVar>();
    RawSegments ahead;
    if (kAhead && k + gridDim.x < tiles) ahead = LoadRaw<kVar>(a, next, off, j, cg);
    const float amax = a.amax_per_p ? raw.amax : shared_amax;
    const SegmentScale s[2] = {ScaleOf<kVar>(a, raw, amax, 0), ScaleOf<kVar>(a, raw, amax, 1)};
    const bool fast = FastSegment<kVar>(s[0]) && FastSegment<kVar>(s[1]);
    Pair* const mine = tile + mine_off;
    if constexpr (kVar == kTransposeRht) {
      StoreRhtPairs<Out>(s, fast, mine);
    } else if (kVar == kTransposePlain && sizeof(Out) == 2 && fast) {
      if constexpr (sizeof(Out) == 2) StoreTablePairs<Out>(s, mine);
    } else if (kVar == kTransposeLocal && sizeof(Out) == 2 && fast) {
      if constexpr (sizeof(Out) == 2) StoreLocalTablePairs<Out>(s, mine);
    } else if (fast) {
      StorePairs<Out, kVar, true>(s, mine);
    } else {
      StorePairs<Out, kVar, false>(s, mine);
    }
    __syncthreads();
    const int64_t r0 = int64_t(pos.rt) * kTR, c0 = int64_t(pos.ct) * kTC;
    Bits* const out = static_cast<Bits*>(a.out) + (pos.p * C + c0) * R + r0;
    if (a.vector_out && r0 + kTR <= R && c0 + kTC <= C) {  // whole tile: no bounds checks
#pragma unroll
      for (int pass = 0; pass < kTC / kRowsPerPass; ++pass) {
        const int orl = orl0 + pass * kRowsPerPass;
        const Pair* src = tile + orl * kPairs + ((run0 * kPairsPerRun) ^ ((orl >> 4) << 3));
        __stcs(reinterpret_cast<uint4*>(out + orl * R + run0 * kV), *reinterpret_cast<const uint4*>(src));
      }
    } else {
      for (int q = t; q < kTC * kRunsPerRow; q += kThreads) {
        const int orl = q / kRunsPerRow, run = q % kRunsPerRow, ocl = run * kV;
        if (c0 + orl >= C || r0 + ocl >= R) continue;
        const Pair* src = tile + orl * kPairs + ((run * kPairsPerRun) ^ ((orl >> 4) << 3));
        Bits* dst = out + orl * R + ocl;
        if (a.vector_out && r0 + ocl + kV <= R) {
          *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
          const Bits* e = reinterpret_cast<const Bits*>(src);
          const int64_t valid = R - (r0 + ocl);
#pragma unroll
          for (int i = 0; i < kV; ++i) {
            if (i < valid) dst[i] = e[i];
          }
        }
      }
    }
    __syncthreads();  // the tile is rewritten for the next position
    if constexpr (!kAhead) break;
    raw = ahead;
    pos = next;
  }
}

template <typename Out, int kVar>
cudaError_t LaunchTransposeVariant(const Args& a, cudaStream_t stream) {
  const int64_t col_tiles = (a.C + kTC - 1) / kTC, row_tiles = (a.R + kTR - 1) / kTR;
  // Bands of at most kMaxBand column tiles, as even as possible (padding: under one tile column per band).
  const int64_t bands = (col_tiles + kMaxBand - 1) / kMaxBand, g = (col_tiles + bands - 1) / bands;
  const int64_t tiles = a.P * row_tiles * bands * g;
  if (tiles >= (int64_t(1) << 31)) return cudaErrorInvalidValue;
  unsigned grid = unsigned(tiles);
  if constexpr (!TileGridPerTile<Out, kVar>()) grid = unsigned((tiles + kTilesPerBlock - 1) / kTilesPerBlock);
  TransposeKernel<Out, kVar><<<grid, kThreads, 0, stream>>>(a, int(row_tiles), int(col_tiles), int(g));
  return cudaGetLastError();
}

// Launches the variant of a.flags (a.vector_data / a.vector_out set by the caller). P * R * C > 0.
template <typename Out>
cudaError_t LaunchTranspose(const Args& a, cudaStream_t stream) {
  if (a.flags & kRht) return LaunchTransposeVariant<Out, kTransposeRht>(a, stream);
  if (a.flags & k1x64) return LaunchTransposeVariant<Out, kTransposeLocal>(a, stream);
  return LaunchTransposeVariant<Out, kTransposePlain>(a, stream);
}

}  // namespace dequantize
}  // namespace jax_fp4
