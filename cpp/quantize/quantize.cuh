// Rowwise + columnwise block-scaled quantization of x[P, M, K] from one read (docs/numerics.md sections 1-3).
//
// One thread block owns a 64x64 tile of one x[p] (256 threads). Thread t loads the 1x16 row segment
// (row t/4, columns 16*(t%4)...) with vector loads and keeps it in registers for the rowwise output; the tile is
// also staged in shared memory as fp32 (16-byte chunks at TileChunk, or RowChunk / ColChunk when kPadded), from which
// thread t reads a 16x1 column segment for the columnwise output. 64 = the 1x64 window, so every block size (16
// NVFP4, 32 MXFP8, 16x16 2D tiles, 64 windows) closes inside a tile: block amaxes combine through warp shuffles
// (rows) or shared memory (columns).
// MXFP8 columnwise data keeps x's layout, so next to a rowwise output, once the column threads have published the
// 32-row blocks' multipliers, the row threads encode it with one 16-byte store each (columnwise alone: the column
// threads store their 16 bytes, which saves a barrier). No atomics, no global scratch: every output byte is written
// exactly once (CUDA-graph safe).
//
// The kernel is bound by instruction issue, not by DRAM, on Hopper (software E2M1: about 9 instructions per element
// and orientation; measurements in docs/kernels/quantize.md), so the work per element is kept minimal: bf16 widening by shifts, 16-byte shared-memory traffic, per-block multipliers from a table
// (MultiplierTable) instead of two correctly rounded reciprocals. Only the mixed pairing gains from loading the next
// tile during the current one (QuantizeTilesStaged: cp.async into shared memory); the MXFP8 kernels hold it in
// registers (QuantizeTilesPrefetched); for the other NVFP4 kernels both cost more registers than they save.
//
// Formats are compile-time "kinds" (one template for every pairing, including NVFP4 rowwise + MXFP8 columnwise);
// NVFP4 options (SR, RHT, 2D, 1x64) are uniform runtime flags.
// Exact operands (Args::row_exact / col_exact: bf16 value(q) * block scale instead of codes, the emulated GEMM's
// operand, which saves the dequantize pass) run in kExact instantiations; every other kernel compiles to the same
// SASS as without them (checked with cuobjdump).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "quantize/quantize_parts.cuh"

namespace jax_fp4 {
namespace quantize {

// What the tiles of one thread block share: x[p], the 64 columns from k0, the NVFP4 tensor encode scales enc_row /
// enc_col (unused for 1x64 and MXFP8) and their MultiplierTable in shared memory, tab_row / tab_col, or null.
struct TileContext {
  int64_t p, k0;
  float enc_row, enc_col;
  const float* tab_row;
  const float* tab_col;
};

// The thread's row segment of one tile as a tiles walker hands it in (QuantizeTile's kGivenPos): its element index
// in x and in the rowwise [P, M, K] layouts and whether its row exists, kept up to date across the tiles of a block
// instead of recomputed with 64-bit products per tile; when use_pre, *pre holds its bytes, prefetched by the walker
// (only ever for a whole vector segment).
template <typename In>
struct GivenSegment {
  bool use_pre;
  const RawSegment<In>* pre;
  int64_t flat;
  bool row_in;
};

// One 64x64 tile of x[ctx.p] (rows m0.., columns ctx.k0..; mt = m0 / 64). Every barrier inside is reached by all
// threads of the block. kGivenPos: the caller passes the row segment's position (and maybe its bytes) in `given`.
template <typename In, int kRow, int kCol, bool kPlain, bool kExact = false, bool kGivenPos = false>
__device__ __forceinline__ void QuantizeTile(const Args& a, const TileContext& ctx, int64_t mt,
                                             const GivenSegment<In>& given = GivenSegment<In>{}) {
  constexpr bool kNeedTile = kCol != kNone;
  constexpr bool kMxCol = kCol == kMxfp8E4m3 || kCol == kMxfp8E5m2;
  __shared__ float4 tile[kNeedTile ? kTile : 1][TileRowChunks<kCol, kPlain>()];  // see kPadded
  __shared__ TileShared sh;
  __shared__ __align__(16) float col_mult[kMxCol && kRow != kNone ? 2 : 1][80];
  __shared__ __align__(16) float col_scale_value[kExact && kMxCol && kRow != kNone ? 2 : 1][80];  // E8M0 values

  const bool row_exact = kExact && a.row_exact, col_exact = kExact && a.col_exact;  // compiled out unless kExact
  const int t = threadIdx.x;
  const int64_t p = ctx.p, k0 = ctx.k0, m0 = mt * kTile;
  const int64_t M = a.M, K = a.K;

  // ---- load: row segment of thread t ----
  const int lr = t >> 2, cg = t & 3;
  const int64_t m = m0 + lr, k = k0 + cg * 16;
  // the segment's element index in x and in the rowwise [P, M, K] layouts
  const int64_t flat = kGivenPos ? given.flat : (p * M + m) * K + k;
  const bool row_in = kGivenPos ? given.row_in : m < M && k < K;
  const int valid = row_in ? int(K - k < 16 ? K - k : 16) : 0;
  float v[16];
  if (kGivenPos && given.use_pre) {  // kGivenPos first: folded early, else the tile loop's schedule shifts
    Widen16<In>(*given.pre, v);
  } else {
    Load16<In>(static_cast<const In*>(a.x) + flat, valid, a.vector_loads, v);
  }
  if constexpr (kNeedTile) {
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      const float4 q = make_float4(v[4 * h], v[4 * h + 1], v[4 * h + 2], v[4 * h + 3]);
      if constexpr (kPadded<kCol, kPlain>) {
        *RowChunk(tile, lr, cg, h) = q;
      } else {
        tile[lr][TileChunk(lr, 4 * cg + h)] = q;  // indexed in place: through a pointer the SASS grew
      }
    }
  }

  // ---- rowwise (v is already staged in shared memory for the columnwise pass) ----
  if constexpr (kRow == kNvfp4) {
    RowNvfp4(a, kPlain ? 0 : a.row_opts, v, sh, lr, cg, row_in, p, m, k, flat, ctx.enc_row, ctx.tab_row, row_exact);
  } else if constexpr (kRow != kNone) {
    RowMxfp8<kRow>(a, v, cg, row_in, p, m, k, flat, row_exact);
  }

  if constexpr (kNeedTile) {
    __syncthreads();
    // ---- columnwise: column segment of thread t ----
    const int lc = ColOfThread<kCol>(t), rb = SegOfThread<kCol>(t);
    const int64_t kc = k0 + lc, mc = m0 + rb * 16;
    const bool col_in = kc < K && mc < M;  // M % 16 == 0 (M % 32 for MXFP8): segments are whole
    float c[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if constexpr (kPadded<kCol, kPlain>) {
        c[i] = reinterpret_cast<const float*>(ColChunk(tile, rb, i, lc))[lc & 3];
      } else {
        const int r = rb * 16 + i;
        c[i] = reinterpret_cast<const float*>(&tile[r][TileChunk(r, lc >> 2)])[lc & 3];
      }
    }
    const int opts = kPlain ? 0 : a.col_opts;
    const float seg_amax = ColSegmentAmax<kCol>(a, opts, c, sh, lc, rb);
    if (ColNeedsExchange<kCol>(a, opts)) __syncthreads();
    ColDbias(a, sh, lc, rb, p, mt, kc);
    if constexpr (kCol == kNvfp4) {
      ColNvfp4(a, opts, c, sh, lc, rb, col_in, p, kc, mc, ctx.enc_col, ctx.tab_col, col_exact, seg_amax);
    } else if constexpr (kRow == kNone) {  // columnwise only: the column threads store their bytes (one barrier less)
      const uint32_t e = ColMxfp8Scale<kCol>(a, sh, lc, rb, col_in, p, kc, mc);
      if (col_in) {
        uint32_t out[4];
        EncodeMxfp8<kCol>(c, e, out);
        const int64_t cflat = (p * M + mc) * K + kc;
        if (col_exact) {
          uint32_t o[8];
          ExactMxfp8Block<kCol>(out, e, o);
          uint16_t* dst = reinterpret_cast<uint16_t*>(a.col_data) + cflat;
#pragma unroll
          for (int i = 0; i < 16; ++i) dst[int64_t(i) * K] = uint16_t(o[i >> 1] >> (16 * (i & 1)));
        } else {
          uint8_t* dst = a.col_data + cflat;
#pragma unroll
          for (int i = 0; i < 16; ++i) dst[int64_t(i) * K] = uint8_t(out[i / 4] >> (8 * (i & 3)));
        }
      }
    } else {
      // MXFP8 columnwise data keeps x's [P, M, K] layout: the column threads publish each column's multiplier, and
      // the row threads encode their row segment (read back from the tile) with 16-byte stores.
      const uint32_t e = ColMxfp8Scale<kCol>(a, sh, lc, rb, col_in, p, kc, mc);
      if ((rb & 1) == 0) {
        col_mult[rb >> 1][MultIndex(lc)] = cvt::E8M0InverseScale(e);
        if (col_exact) col_scale_value[rb >> 1][MultIndex(lc)] = dequantize::E8M0Value(e);
      }
      __syncthreads();
      if (row_in) {
        const float4* mult = reinterpret_cast<const float4*>(&col_mult[lr >> 5][MultIndex(cg * 16)]);
        uint32_t out[4];
#pragma unroll
        for (int h = 0; h < 4; ++h) {
          const float4 xv = tile[lr][TileChunk(lr, 4 * cg + h)], mv = mult[h];  // MXFP8 columns: never padded
          const float y0 = __fmul_rn(xv.x, mv.x), y1 = __fmul_rn(xv.y, mv.y);
          const float y2 = __fmul_rn(xv.z, mv.z), y3 = __fmul_rn(xv.w, mv.w);
          out[h] = kCol == kMxfp8E4m3 ? (cvt::E4M3x2(y0, y1) | (cvt::E4M3x2(y2, y3) << 16))
                                      : (cvt::E5M2x2(y0, y1) | (cvt::E5M2x2(y2, y3) << 16));
        }
        if (col_exact) {
          const float4* sv = reinterpret_cast<const float4*>(&col_scale_value[lr >> 5][MultIndex(cg * 16)]);
          float scale[16];
#pragma unroll
          for (int h = 0; h < 4; ++h) {
            const float4 s4 = sv[h];
            scale[4 * h] = s4.x, scale[4 * h + 1] = s4.y, scale[4 * h + 2] = s4.z, scale[4 * h + 3] = s4.w;
          }
          uint32_t o[8];
          ExactMxfp8<kCol>(out, scale, o);
          StoreBf16x16(a.col_data + 2 * flat, o, valid, K % 16 == 0);
        } else {
          uint8_t* dst = a.col_data + flat;
          if (K % 16 == 0) {
            *reinterpret_cast<uint4*>(dst) = make_uint4(out[0], out[1], out[2], out[3]);
          } else {  // rows not 16-byte aligned: byte stores of the valid elements
            // Unrolled, so out[] is indexed by constants and stays in registers (see PickWord; unrolled rather than
            // picked: it left the grouped MXFP8 row+col tile loop spill-free).
#pragma unroll
            for (int i = 0; i < 16; ++i) {
              if (i < valid) dst[i] = uint8_t(out[i >> 2] >> (8 * (i & 3)));
            }
          }
        }
      }
    }
  }
}

// MXFP8 kernels (no NVFP4 side): tiles [mt0, mt1) of the 64 columns from k0 of x[p], each thread loading the next
// tile's row segment before it works on the current one, so its bytes are in flight during the current tile's
// barriers and encodes (whole vector segments only; QuantizeTile loads any other itself). Not in NVFP4 kernels: the
// held segment pushed them from 62 to 117 registers. The thread's segment of tile mt starts at element
// flat = (p * M + 64 mt + lr) * K + k of x (and of the rowwise outputs); it and the rows left below it advance by one
// tile per step instead of being recomputed. mt0 / mt1 are uniform over the block (every barrier is reached by all
// threads); shared by QuantizeKernel and the grouped kernel. ctx's encode scales and tables go unused (no NVFP4 side).
template <typename In, int kRow, int kCol, bool kPlain, bool kExact>
__device__ __forceinline__ void QuantizeTilesPrefetched(const Args& a, const TileContext& ctx, int64_t mt0,
                                                        int64_t mt1) {
  const In* x = static_cast<const In*>(a.x);
  const int64_t p = ctx.p, k0 = ctx.k0;
  const int lr = int(threadIdx.x >> 2);
  const int64_t k = k0 + (threadIdx.x & 3) * 16, tile_elems = int64_t(kTile) * a.K;
  const bool k_ok = a.vector_loads && k + 16 <= a.K, k_in = k < a.K;
  int64_t flat = (p * a.M + mt0 * kTile + lr) * a.K + k, rows_left = a.M - (mt0 * kTile + lr);
  RawSegment<In> next{};
  bool have = mt0 < mt1 && k_ok && rows_left > 0;
  if (have) LoadRaw<In>(x + flat, next);
  for (int64_t mt = mt0; mt < mt1; ++mt) {
    const RawSegment<In> cur = next;
    const bool cur_ok = have;
    if (mt + 1 < mt1) {
      have = k_ok && rows_left > kTile;  // the next tile's row of this thread exists
      if (have) LoadRaw<In>(x + flat + tile_elems, next);
    }
    QuantizeTile<In, kRow, kCol, kPlain, kExact, true>(a, ctx, mt, {cur_ok, &cur, flat, k_in && rows_left > 0});
    flat += tile_elems;
    rows_left -= kTile;
    __syncthreads();  // shared memory is reused by the next tile
  }
}

// 16-byte asynchronous global -> shared copy (sm_80 cp.async, L2 only) and its group bookkeeping.
__device__ __forceinline__ void CopyAsync16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(uint32_t(__cvta_generic_to_shared(dst))), "l"(src)
               : "memory");
}
__device__ __forceinline__ void CopyAsyncCommit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void CopyAsyncWaitAll() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// The kStagedPairing kernels (below): tiles [mt0, mt1) of the 64 columns from k0 of x[p], the next tile copied into a
// double-buffered shared-memory stage with cp.async while the current one is encoded (holding it in registers pushed
// the NVFP4 kernels from 62 to 117 registers). The block copies a tile as 512 16-byte chunks, thread t chunks t and
// t + 256 (a warp copies 4 whole rows: coalesced); chunk c of row r sits at 16-byte slot c ^ (r & 1) of the stage row,
// so the two 16-byte reads of a row segment by a quarter warp (rows r, r + 1 x 4 column groups) hit distinct banks.
// One barrier a tile (before its stage is read) also separates the previous tile's shared-memory reads from this
// tile's writes.
template <typename In, int kRow, int kCol, bool kPlain, bool kExact>
__device__ __forceinline__ void QuantizeTilesStaged(const Args& a, const TileContext& ctx, int64_t mt0, int64_t mt1) {
  static_assert(sizeof(In) == 2, "a 64-column tile row of 16-bit input is 8 chunks");
  __shared__ uint4 stage[2][kTile][8];
  const In* x = static_cast<const In*>(a.x);
  const int64_t p = ctx.p, k0 = ctx.k0;
  const int t = int(threadIdx.x), lr = t >> 2, cg = t & 3;
  const int64_t K = a.K, tile_elems = int64_t(kTile) * K;
  // chunks t and t + 256: rows cr and cr + 32, 16-byte column cc
  const int cr = t >> 3, cc = t & 7;
  const bool c_ok = a.vector_loads && k0 + cc * 8 < K;  // K % 8 == 0 under vector_loads: chunks are whole or absent
  const In* src = x + (p * a.M + mt0 * kTile + cr) * K + k0 + cc * 8;
  int64_t rows_left = a.M - (mt0 * kTile + cr);  // rows from chunk row cr of the tile to the end of x[p]
  const int slot = cc ^ (cr & 1);               // cr + 32 has the same parity
  // the thread's own row segment
  const int64_t k = k0 + cg * 16;
  const bool seg_ok = a.vector_loads && k + 16 <= K, k_in = k < K;
  int64_t flat = (p * a.M + mt0 * kTile + lr) * K + k, seg_rows_left = a.M - (mt0 * kTile + lr);
  auto issue = [&](int b) {
    if (c_ok && rows_left > 0) CopyAsync16(&stage[b][cr][slot], src);
    if (c_ok && rows_left > 32) CopyAsync16(&stage[b][cr + 32][slot], src + 32 * K);
    CopyAsyncCommit();
  };
  if (mt0 < mt1) issue(0);
  for (int64_t mt = mt0; mt < mt1; ++mt) {  // uniform trip count: the barriers are reached by all threads
    const int buf = int(mt - mt0) & 1;
    CopyAsyncWaitAll();  // this thread's chunks of tile mt
    __syncthreads();     // everyone's chunks; the previous tile's shared-memory reads are done
    const bool cur_ok = seg_ok && seg_rows_left > 0;
    RawSegment<In> cur;
    cur.w[0] = stage[buf][lr][(2 * cg) ^ (lr & 1)];
    cur.w[1] = stage[buf][lr][(2 * cg + 1) ^ (lr & 1)];
    if (mt + 1 < mt1) {
      src += tile_elems;
      rows_left -= kTile;
      issue(buf ^ 1);
    }
    QuantizeTile<In, kRow, kCol, kPlain, kExact, true>(a, ctx, mt, {cur_ok, &cur, flat, k_in && seg_rows_left > 0});
    flat += tile_elems;
    seg_rows_left -= kTile;
  }
  __syncthreads();  // the caller may reuse shared memory
}

// The kernels that walk their tiles through QuantizeTilesStaged: NVFP4 rowwise + MXFP8 columnwise codes on 16-bit
// input (the pass of the NVFP4-forward / MXFP8-backward recipe), which gains 2-6 points of copy from it; the other
// NVFP4 pairings lose (registers: row+col 60 -> 117) and keep QuantizeTile's own loads (docs/kernels/quantize.md).
template <typename In, int kRow, int kCol, bool kExact>
constexpr bool kStagedPairing =
    sizeof(In) == 2 && kRow == kNvfp4 && (kCol == kMxfp8E4m3 || kCol == kMxfp8E5m2) && !kExact;

// Thread block (blockIdx.x, blockIdx.y, p) walks tiles_per_cta tiles down the rows, so that the per-thread setup, the
// tensor encode scales and their multiplier tables are computed once per block.
// Resident blocks per SM (__launch_bounds__; 0: none, the same code as no bound), each the fastest measured
// (docs/kernels/quantize.md): MXFP8 none (a bound changes their schedule and was slower); plain NVFP4 5 (48
// registers); NVFP4 with options none (5 blocks cost them); exact NVFP4-rowwise + MXFP8-columnwise 4 (unbounded,
// ptxas spills them); staged (mixed) plain 5, with options 4 (at 48 registers they spill).
template <typename In, int kRow, int kCol, bool kPlain, bool kExact>
constexpr int QuantizeMinBlocks() {
  if (kExact) return kRow == kNvfp4 && (kCol == kMxfp8E4m3 || kCol == kMxfp8E5m2) ? 4 : 0;
  if (kStagedPairing<In, kRow, kCol, kExact>) return kPlain ? 5 : 4;
  return kPlain && (kRow == kNvfp4 || kCol == kNvfp4) ? 5 : 0;
}

template <typename In, int kRow, int kCol, bool kPlain, bool kExact>
__global__ void __launch_bounds__(kThreads, QuantizeMinBlocks<In, kRow, kCol, kPlain, kExact>())
    QuantizeKernel(const Args a) {
  __shared__ float tab[2][128];
  const int64_t p = blockIdx.z, k0 = int64_t(blockIdx.x) * kTile;
  const int64_t m_tiles = (a.M + kTile - 1) / kTile;
  const int row_opts = kPlain ? 0 : a.row_opts, col_opts = kPlain ? 0 : a.col_opts;
  const bool row_tab = kRow == kNvfp4 && !(row_opts & k1x64), col_tab = kCol == kNvfp4 && !(col_opts & k1x64);
  const float enc_row = row_tab ? TensorEncodeScale(a.amax_row[p], row_opts) : 1.0f;
  const float enc_col = col_tab ? TensorEncodeScale(a.amax_col[p], col_opts) : 1.0f;
  if constexpr (kRow == kNvfp4 || kCol == kNvfp4) {  // MXFP8 kernels start loading at once
    if (row_tab) MultiplierTable(tab[0], enc_row, 0);
    if (col_tab) MultiplierTable(tab[1], enc_col, 128);
    __syncthreads();
  }
  const int64_t mt0 = int64_t(blockIdx.y) * a.tiles_per_cta;
  const int64_t mt1 = mt0 + a.tiles_per_cta < m_tiles ? mt0 + a.tiles_per_cta : m_tiles;
  const TileContext ctx{p, k0, enc_row, enc_col, row_tab ? tab[0] : nullptr, col_tab ? tab[1] : nullptr};
  if constexpr (kRow != kNvfp4 && kCol != kNvfp4) {
    QuantizeTilesPrefetched<In, kRow, kCol, kPlain, kExact>(a, ctx, mt0, mt1);
  } else if constexpr (kStagedPairing<In, kRow, kCol, kExact>) {
    QuantizeTilesStaged<In, kRow, kCol, kPlain, kExact>(a, ctx, mt0, mt1);
  } else {
    // The context is built per tile: built once before the loop (ctx), the NVFP4 row+col kernels with options were
    // register-allocated differently (same instructions, other registers).
    for (int64_t mt = mt0; mt < mt1; ++mt) {  // uniform trip count: the barriers below are reached by all threads
      QuantizeTile<In, kRow, kCol, kPlain, kExact>(
          a, TileContext{p, k0, enc_row, enc_col, row_tab ? tab[0] : nullptr, col_tab ? tab[1] : nullptr}, mt);
      __syncthreads();  // shared memory is reused by the next tile
    }
  }
}

// Host-side launch: grid (ceil(K/64), ceil(ceil(M/64) / tiles_per_cta), P).
template <typename In, int kRow, int kCol>
cudaError_t Launch(Args args, cudaStream_t stream) {
  const int64_t k_tiles = (args.K + kTile - 1) / kTile, m_tiles = (args.M + kTile - 1) / kTile;
  const int64_t tiles = k_tiles * m_tiles * args.P;
  // Amortise the per-block setup over 2-4 tiles (>= 512 blocks either way). MXFP8 ran fastest with one tile per
  // block until its kernels prefetched the next tile (row+col 92.4 -> 87.5 us at 8192^2 on an H200 with 4).
  args.tiles_per_cta = tiles >= 2048 ? 4 : (tiles >= 256 ? 2 : 1);
  const dim3 grid(unsigned(k_tiles), unsigned((m_tiles + args.tiles_per_cta - 1) / args.tiles_per_cta),
                  unsigned(args.P));
  // Exact operands run in their own instantiations, so the stores they add cost the code-writing kernels nothing;
  // kPlain (NVFP4 without options) exists only where an NVFP4 side does.
  const bool exact = args.row_exact || args.col_exact;
  if constexpr (kRow == kNvfp4 || kCol == kNvfp4) {
    if (args.row_opts == 0 && args.col_opts == 0) {
      if (exact) {
        QuantizeKernel<In, kRow, kCol, true, true><<<grid, kThreads, 0, stream>>>(args);
      } else {
        QuantizeKernel<In, kRow, kCol, true, false><<<grid, kThreads, 0, stream>>>(args);
      }
      return cudaGetLastError();
    }
  }
  if (exact) {
    QuantizeKernel<In, kRow, kCol, false, true><<<grid, kThreads, 0, stream>>>(args);
  } else {
    QuantizeKernel<In, kRow, kCol, false, false><<<grid, kThreads, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace quantize
}  // namespace jax_fp4
