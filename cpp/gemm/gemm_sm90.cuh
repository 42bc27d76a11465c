// Block-scaled GEMM for Hopper (sm_90a): out[m, n] = ta * tb * sum_w fa[m, w] fb[n, w] sum_{k in w} va[m, k] vb[n, k]
// + bias[n] (docs/kernels/gemm.md, docs/numerics.md section 7). Both operands are K-major ("TN"): packed E2M1 codes
// with E4M3 1x16 block scales (NVFP4) or E4M3 / E5M2 codes with E8M0 1x32 block scales (MXFP8), compact scales.
//
// One CTA computes a 128 x 256 tile of the output (NVFP4 1x64: 128 x 128) with two warpgroups (256 threads), each a
// 64-row slice, on CuTe's SM90 WGMMA atom (bf16 x bf16 -> fp32, both operands from 128-byte-swizzled shared memory).
// K runs in 64-wide K-tiles (Config: tile sizes, stages):
//  * every thread decodes half rows (32 codes) of A's and B's next K-tile, value(code) * block scale, into exact
//    bfloat16 (<= 6 significant bits for NVFP4: always exact; MXFP8 rounds as the emulation's dequantize does,
//    RN_bf16(RN_f32(value * 2^(e-127)))), and stores them into that K-tile's shared-memory stage while the current
//    tile's WGMMAs run asynchronously (one batch stays in flight across the barrier, three stages);
//  * the codes of the K-tile after that are loaded into a second register set at the start of the iteration, so
//    their global latency hides behind the decode;
//  * NVFP4 1x64: the K-tile is one window; its WGMMAs accumulate into a zeroed temporary fragment, promoted into the
//    accumulator as acc = fma(tmp * fa[m], fb[n], acc) (fa = RN(1 / S_enc,w) of row m's window, from the window
//    amax);
//  * the epilogue multiplies by ta then tb (NVFP4 tensor scales amax * fp32(1/2688), 1 otherwise), adds the bias,
//    casts (RNE, canonical NaN) and stores with bounds checks; with kEmitAmax it folds max |out| (NaN if any output
//    is NaN) into out_amax with a warp reduction and an atomicMax on the float bits (zeroed on the stream first).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>

#include "common/convert.cuh"
#include "common/ffi_codes.h"
#include "dequantize/decode.cuh"
#include "dequantize/half_table.cuh"

namespace jax_fp4 {
namespace gemm {

constexpr int kBM = 128, kBK = 64, kThreads = 256;

// Kernel arguments. Row strides in bytes follow from K: NVFP4 codes K / 2, MXFP8 codes K; scales K / 16 or K / 32.
struct Params {
  const uint8_t* a;         // [M, K] codes
  const uint8_t* a_scale;   // [M, K / bs] compact block scales
  const float* a_aux;       // NVFP4 tensor amax [] (a_tensor), NVFP4 1x64 window amax [M, K / 64], else unused
  const uint8_t* b;         // [N, K]
  const uint8_t* b_scale;   // [N, K / bs]
  const float* b_aux;
  const float* bias;        // [N] or nullptr
  void* out;                // [M, N] bfloat16 or float32
  unsigned* out_amax;       // float bits of max |out|, or nullptr
  int64_t M, N, K;
  int a_e5m2, b_e5m2;       // MXFP8 element (E5M2 if set, else E4M3)
  int a_tensor, b_tensor;   // NVFP4 operand with a tensor amax
  int out_f32;              // float32 output (else bfloat16)
};

// The codes (and scales) of one thread's half row of a K-tile: 32 codes from k0 = kt * 64 + 32 * half.
struct Fp4Regs {
  uint2 d[2];     // two 16-code blocks (8 bytes each)
  uint32_t s[2];  // their E4M3 block scales
  float w;        // window amax (1x64)
};
struct Fp8Regs {
  uint4 d[2];  // one 32-code block
  uint32_t s;  // its E8M0 block scale
};

// One thread's half row of an operand: its codes, block scales and (1x64) window amax at K-tile 0, and whether the
// row exists. Computed once; a K-tile's loads then only add the K-tile's offset.
struct HalfRow {
  const uint8_t* data;   // code byte of k = 32 * half
  const uint8_t* scale;  // its block scale
  const float* aux;      // the row's window amax (1x64)
  bool in;               // row < rows (else every load reads as zero)
};

template <bool kFp4>
__device__ __forceinline__ HalfRow MakeHalfRow(const uint8_t* data, const uint8_t* scale, const float* aux,
                                               int64_t row, int64_t rows, int64_t K, int half) {
  const bool in = row < rows;
  const int64_t r = in ? row : 0;
  const int64_t code_bytes = kFp4 ? K / 2 : K, scale_bytes = kFp4 ? K / 16 : K / 32;
  return HalfRow{data + r * code_bytes + (kFp4 ? 16 : 32) * half, scale + r * scale_bytes + (kFp4 ? 2 : 1) * half,
                 aux + r * (K / 64), in};
}

// Loads K-tile kt of a half row with a bounds check on K (whole blocks: K is a multiple of the block size, so each
// block is either inside or outside). Rows / blocks outside read as zero codes with zero scale codes: decoded,
// exact zeros. k = kt * 64 + 32 * half (+ 16 j) is below 2^31 (the handler checks K).
template <bool kLocal>
__device__ __forceinline__ void LoadFp4(Fp4Regs& r, const HalfRow& h, int K, int kt, int half) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    if (h.in && kt * kBK + 32 * half + 16 * j < K) {
      r.d[j] = __ldg(reinterpret_cast<const uint2*>(h.data + kt * (kBK / 2) + 8 * j));
      r.s[j] = __ldg(h.scale + kt * (kBK / 16) + j);
    } else {
      r.d[j] = make_uint2(0u, 0u);
      r.s[j] = 0u;
    }
  }
  if constexpr (kLocal) r.w = h.in ? __ldg(h.aux + kt) : 0.0f;
}

__device__ __forceinline__ void LoadFp8(Fp8Regs& r, const HalfRow& h, int K, int kt, int half) {
  if (h.in && kt * kBK + 32 * half < K) {
    const uint4* q = reinterpret_cast<const uint4*>(h.data + kt * kBK);
    r.d[0] = __ldg(q);
    r.d[1] = __ldg(q + 1);
    r.s = __ldg(h.scale + kt * (kBK / 32));
  } else {
    r.d[0] = r.d[1] = make_uint4(0u, 0u, 0u, 0u);
    r.s = 0u;
  }
}

// The 1x64 decode factor RN(1 / S_enc,w) of a window with amax A: S_enc,w = min(2688 / max(A, 1e-12), FLT_MAX),
// 1 for A == 0 (docs/numerics.md section 1, the reference's quantize_1x64 / dequantize), both divisions IEEE. A NaN
// amax (a window that held a NaN) gives NaN, as the reference's decode (docs/numerics.md section 6).
__device__ __forceinline__ float WindowFactor(float amax) {
  constexpr float kFltMax = 3.402823466e38f;
  if (amax == 0.0f) return 1.0f;
  if (amax != amax) return amax;
  return __fdiv_rn(1.0f, fminf(__fdiv_rn(2688.0f, fmaxf(amax, cvt::kWindowFloor())), kFltMax));
}

// Shared-memory tile layouts: K-major, 128-byte swizzle (the WGMMA descriptor's SW128 K-major mode).
using SmemAtom = cute::GMMA::Layout_K_SW128_Atom<cute::bfloat16_t>;
template <int kRows, int kStages>
using SmemLayout = decltype(cute::tile_to_shape(SmemAtom{}, cute::make_shape(cute::Int<kRows>{}, cute::Int<kBK>{},
                                                                              cute::Int<kStages>{})));

// The tile configuration. Plain products: 128 x 256 tiles (each warpgroup 64 x 256, 128 accumulators a thread),
// three shared-memory stages, the WGMMAs of one K-tile left in flight across the barrier that ends each iteration
// (warpgroup_wait<1>), so the tensor cores never drain between K-tiles. 1x64: 128 x 128 tiles (the accumulator
// comes with a fragment of window sums) and two stages; each K-tile's WGMMAs complete before their promotion.
template <bool kLocal>
struct Config {
  static constexpr int kBN = kLocal ? 128 : 256;
  static constexpr int kStages = kLocal ? 2 : 3;
  static constexpr int kBHalfRows = kBN / 128;   // half rows of B a thread decodes per K-tile
  using LayoutA = SmemLayout<kBM, kStages>;
  using LayoutB = SmemLayout<kBN, kStages>;
  using Atom = std::conditional_t<kLocal,
                                  cute::SM90_64x128x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>,
                                  cute::SM90_64x256x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>>;
  using TiledMma = decltype(cute::make_tiled_mma(Atom{}, cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  struct alignas(1024) SharedStorage {
    cute::array_aligned<cute::bfloat16_t, cute::cosize_v<LayoutA>, 1024> a;
    cute::array_aligned<cute::bfloat16_t, cute::cosize_v<LayoutB>, 1024> b;
    float fa[kStages][kBM];  // 1x64 window decode factors of the stage's rows
    float fb[kStages][kBN];
  };
};

// Stores 8 bf16 values (16 bytes) at row `r`, columns 8c .. 8c + 7 of stage `st` of the swizzled tile `s` (the
// CuTe tensor computes the swizzled address; st.shared, as a generic store would check the address space per access).
template <typename STensor>
__device__ __forceinline__ void Store8(STensor& s, int r, int c, int st, uint4 v) {
  const uint32_t addr = uint32_t(__cvta_generic_to_shared(&s(r, 8 * c, st)));
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// The byte table of the 8 bf16 values value(q) * s_b of an NVFP4 block (dequantize/half_table.cuh). For a positive
// finite scale (E4M3 codes 0x01..0x7E: s_b in [2^-9, 448], normal in bf16) the products are exact and the table
// comes from two of them by exponent arithmetic: P = (bf16(s_b), bf16(1.5 s_b)) is the pair of magnitudes (1, 1.5);
// (2, 3) and (4, 6) add 1 and 2 to both exponents; (0, 0.5) is (+0, bf16(s_b) with the exponent decremented). Other
// codes (zero, negative, NaN) take the per-magnitude multiplications.
__device__ __forceinline__ dequantize::HalfTable Fp4Table(uint32_t scale_code) {
  const float sb = dequantize::Fp8Value<codes::kMxfp8E4m3>(scale_code);
  if (scale_code - 1u < 0x7Eu) {
    const __nv_bfloat162 pb = __floats2bfloat162_rn(sb, __fmul_rn(1.5f, sb));  // exact
    const uint32_t p = *reinterpret_cast<const uint32_t*>(&pb);
    const uint32_t t[4] = {(p << 16) - 0x00800000u, p, p + 0x00800080u, p + 0x01000100u};
    return dequantize::HalfTableOfPairs(t);
  }
  return dequantize::MakeHalfTable<__nv_bfloat16>(sb);
}

// Decodes one thread's 32 NVFP4 codes (two 16-blocks) into chunks 4 * half .. 4 * half + 3 of row r: the block's
// 8 magnitudes times s_b round once into a byte table (value(q) * s_b has <= 6 significant bits: exact in bf16).
template <typename STensor>
__device__ __forceinline__ void DecodeFp4(const Fp4Regs& r, STensor& s, int row, int half, int st) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const dequantize::HalfTable tab = Fp4Table(r.s[j]);
    Store8(s, row, 4 * half + 2 * j, st, dequantize::TableRun8(tab, r.d[j].x));
    Store8(s, row, 4 * half + 2 * j + 1, st, dequantize::TableRun8(tab, r.d[j].y));
  }
}

// bf16 bits of the emulation's MXFP8 operand value of one code under E8M0 code e (dequantize::MxDecode with bf16's
// range): DecodeFp8's path for a half whose bf16x2 product overflowed (out of line: rare, keeps the loop's registers).
template <__nv_fp8_interpretation_t kElem>
__device__ __noinline__ uint32_t MxBf16(uint32_t code, uint32_t e) {
  constexpr int kKind = kElem == __NV_E4M3 ? codes::kMxfp8E4m3 : codes::kMxfp8E5m2;
  const float v = dequantize::MxDecode<kKind>(code, dequantize::E8M0Value(e), dequantize::kBf16MaxBits);
  return dequantize::OutBits<__nv_bfloat16>(v);
}

// Decodes one thread's 32 MXFP8 codes: RN_bf16(value * 2^(e-127)). Per pair of codes: one fp8x2 -> f16x2
// conversion, two exact widenings, one exact bf16x2 pack (E4M3 / E5M2 values have <= 4 significant bits and lie in
// [2^-16, 57344], normal in bf16), and one bf16x2 multiply by the scale 2^(e-127) (a bf16: 2^-127 is a bf16
// subnormal, e = 255 NaN), correctly rounded with subnormals kept. The exact product's lowest bit is >= 2^-143, so
// it is exact in fp32 and this single rounding equals the emulation's RN_bf16(RN_f32(value * scale)). An infinite
// half is redone by MxBf16: a code that rounded up past bf16's range gives bf16 max, as the emulation's dequantize
// (docs/numerics.md section 2, Dequantize).
template <__nv_fp8_interpretation_t kElem, typename STensor>
__device__ __forceinline__ void DecodeFp8(const Fp8Regs& r, STensor& s, int row, int half, int st) {
  const uint32_t e = r.s & 0xFFu;
  const uint32_t sb = e == 255u ? 0x7FC0u : (e == 0u ? 0x0040u : e << 7);
  const uint32_t sb2 = sb | (sb << 16);
  const __nv_bfloat162 sc = *reinterpret_cast<const __nv_bfloat162*>(&sb2);
  const uint32_t w[8] = {r.d[0].x, r.d[0].y, r.d[0].z, r.d[0].w, r.d[1].x, r.d[1].y, r.d[1].z, r.d[1].w};
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    uint32_t o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t word = w[2 * c + i / 2];
      const uint32_t pair = (i & 1) ? (word >> 16) : (word & 0xFFFFu);
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), kElem);
      const float2 f = __half22float2(__half2(h));
      const __nv_bfloat162 b = __hmul2_rn(__floats2bfloat162_rn(f.x, f.y), sc);
      o[i] = *reinterpret_cast<const uint32_t*>(&b);
      if ((o[i] & 0x7FFFu) == 0x7F80u) o[i] = (o[i] & 0xFFFF0000u) | MxBf16<kElem>(pair & 0xFFu, e);
      if ((o[i] & 0x7FFF0000u) == 0x7F800000u) o[i] = (o[i] & 0xFFFFu) | (MxBf16<kElem>(pair >> 8, e) << 16);
    }
    Store8(s, row, 4 * half + c, st, make_uint4(o[0], o[1], o[2], o[3]));
  }
}

template <bool kFp4>
struct OperandRegs;
template <>
struct OperandRegs<true> { using type = Fp4Regs; };
template <>
struct OperandRegs<false> { using type = Fp8Regs; };

template <bool kFp4, bool kLocal>
__device__ __forceinline__ void Load(typename OperandRegs<kFp4>::type& r, const HalfRow& h, int K, int kt, int half) {
  if constexpr (kFp4) {
    LoadFp4<kLocal>(r, h, K, kt, half);
  } else {
    LoadFp8(r, h, K, kt, half);
  }
}

template <bool kFp4, bool kLocal, typename STensor>
__device__ __forceinline__ void Decode(const typename OperandRegs<kFp4>::type& r, STensor& s, float* factors, int row,
                                       int half, int st, int e5m2) {
  if constexpr (kFp4) {
    DecodeFp4(r, s, row, half, st);
    if constexpr (kLocal) {
      if (half == 0) factors[row] = WindowFactor(r.w);
    }
  } else if (e5m2) {
    DecodeFp8<__NV_E5M2>(r, s, row, half, st);
  } else {
    DecodeFp8<__NV_E4M3>(r, s, row, half, st);
  }
}

// Output tile order: groups of kGroupM tile rows walked column by column, so neighbouring CTAs share A and B tiles
// in L2.
constexpr int kGroupM = 8;

template <bool kFp4A, bool kFp4B, bool kLocal>
__global__ void __launch_bounds__(kThreads, 1) GemmKernel(const Params p) {
#if defined(__CUDA_ARCH__) && defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  using namespace cute;
  using Cfg = Config<kLocal>;
  constexpr int kBN = Cfg::kBN, kStages = Cfg::kStages;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  auto& smem = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);
  Tensor sA = make_tensor(make_smem_ptr(smem.a.data()), typename Cfg::LayoutA{});  // (BM, BK, stage)
  Tensor sB = make_tensor(make_smem_ptr(smem.b.data()), typename Cfg::LayoutB{});  // (BN, BK, stage)

  // Tile coordinates (grouped order).
  const int64_t tiles_m = (p.M + kBM - 1) / kBM, tiles_n = (p.N + kBN - 1) / kBN;
  const int64_t tile = blockIdx.x, per_group = int64_t(kGroupM) * tiles_n;
  const int64_t group = tile / per_group, first_m = group * kGroupM;
  const int64_t group_m = min(tiles_m - first_m, int64_t(kGroupM));
  const int64_t tm = first_m + (tile % per_group) % group_m, tn = (tile % per_group) / group_m;
  const int64_t m0 = tm * kBM, n0 = tn * kBN;

  // The half rows this thread decodes: half row h = tid + 256 i is row h / 2, codes 32 (h % 2) .. + 31 of the K-tile
  // (one of A's 256 half rows; kBHalfRows of B's).
  const int tid = threadIdx.x;
  const int drow = tid >> 1, dhalf = tid & 1;
  const int KT = int((p.K + kBK - 1) / kBK);

  typename Cfg::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tCsA = thr_mma.partition_A(sA);           // (MMA, MMA_M, MMA_K, stage)
  Tensor tCsB = thr_mma.partition_B(sB);           // (MMA, MMA_N, MMA_K, stage)
  Tensor tCrA = thr_mma.make_fragment_A(tCsA);     // smem descriptors
  Tensor tCrB = thr_mma.make_fragment_B(tCsB);
  Tensor acc = partition_fragment_C(tiled_mma, Shape<Int<kBM>, Int<kBN>>{});  // (MMA, MMA_M, MMA_N) fp32
  Tensor cC = make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{});
  Tensor tCcC = thr_mma.partition_C(cC);           // the (m, n) of each accumulator element, tile-relative
  clear(acc);

  // Codes of one K-tile in registers: `cur` holds the K-tile decoded next, `nxt` the one after it, loaded an
  // iteration before its use so that the global latency hides behind a whole decode.
  struct Regs {
    typename OperandRegs<kFp4A>::type a;
    typename OperandRegs<kFp4B>::type b[Cfg::kBHalfRows];
  };
  Regs cur, nxt;
  const HalfRow ha = MakeHalfRow<kFp4A>(p.a, p.a_scale, p.a_aux, m0 + drow, p.M, p.K, dhalf);
  HalfRow hb[Cfg::kBHalfRows];
#pragma unroll
  for (int i = 0; i < Cfg::kBHalfRows; ++i) {
    hb[i] = MakeHalfRow<kFp4B>(p.b, p.b_scale, p.b_aux, n0 + 128 * i + drow, p.N, p.K, dhalf);
  }
  const int K = int(p.K);
  auto load = [&](Regs& r, int kt) {
    Load<kFp4A, kLocal>(r.a, ha, K, kt, dhalf);
#pragma unroll
    for (int i = 0; i < Cfg::kBHalfRows; ++i) Load<kFp4B, kLocal>(r.b[i], hb[i], K, kt, dhalf);
  };
  auto decode = [&](const Regs& r, int st) {
    Decode<kFp4A, kLocal>(r.a, sA, smem.fa[st], drow, dhalf, st, p.a_e5m2);
#pragma unroll
    for (int i = 0; i < Cfg::kBHalfRows; ++i) {
      Decode<kFp4B, kLocal>(r.b[i], sB, smem.fb[st], 128 * i + drow, dhalf, st, p.b_e5m2);
    }
  };
  if (KT > 0) {
    load(cur, 0);
    decode(cur, 0);
    if (KT > 1) load(cur, 1);
    cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> visible to the WGMMA (async proxy) reads
    __syncthreads();
  }

  // Issues the WGMMAs of the K-tile in stage `st` into the fragment `c`, asynchronously (`zero`: c = A B, else
  // c += A B).
  auto mma = [&](int st, auto& c, bool zero) {
    warpgroup_fence_operand(c);
    warpgroup_arrive();
    tiled_mma.accumulate_ = zero ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tCrA); ++kb) {
      cute::gemm(tiled_mma, tCrA(_, _, kb, st), tCrB(_, _, kb, st), c);
      tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  };
  // Loads K-tile kt + 2's codes (into `nxt`) and decodes K-tile kt + 1 (in `cur`) into its stage `next`, whose last
  // readers (the WGMMAs of K-tile kt + 1 - kStages, and for 1x64 the promotion of its factors) completed before the
  // barrier ending the previous iteration (at most one WGMMA batch stays outstanding there); then moves `nxt` to `cur`
  // (the move waits for the loads, a decode later).
  auto prepare_next = [&](int kt, int next) {
    if (kt + 2 < KT) load(nxt, kt + 2);
    if (kt + 1 < KT) {
      decode(cur, next);
      cutlass::arch::fence_view_async_shared();
    }
    if (kt + 2 < KT) cur = nxt;
  };
  auto advance = [](int st) { return st + 1 == kStages ? 0 : st + 1; };

  if constexpr (!kLocal) {
    int st = 0;  // the stage of K-tile kt
    for (int kt = 0; kt < KT; ++kt) {
      const int next = advance(st);
      mma(st, acc, false);
      prepare_next(kt, next);
      warpgroup_wait<1>();  // the batch of K-tile kt - 1 is complete (kt's may still run)
      __syncthreads();      // K-tile kt + 1's stage is complete on every thread
      st = next;
    }
  } else {
    // 1x64: each K-tile's window sums go to a zeroed temporary fragment and are complete (warpgroup_wait<0>) before
    // their promotion acc = fma(tmp * fa[m], fb[n], acc). (Alternating two fragments to overlap the promotion with
    // the next K-tile's WGMMAs makes ptxas serialize every WGMMA: it reads accumulator registers inside the
    // pipeline.)
    auto tmp = make_fragment_like(acc);
    int st = 0;
    for (int kt = 0; kt < KT; ++kt) {
      const int next = advance(st);
      mma(st, tmp, true);
      prepare_next(kt, next);
      warpgroup_wait<0>();
      warpgroup_fence_operand(tmp);
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i) {
        const int m = get<0>(tCcC(i)), n = get<1>(tCcC(i));
        acc(i) = __fmaf_rn(__fmul_rn(tmp(i), smem.fa[st][m]), smem.fb[st][n], acc(i));
      }
      __syncthreads();  // K-tile kt + 1's stage and factors are complete on every thread
      st = next;
    }
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);

  // Epilogue: * ta, * tb, + bias, cast, bounds-checked store, amax.
  const float ta = p.a_tensor ? __fmul_rn(__ldg(p.a_aux), cvt::kInv2688()) : 1.0f;
  const float tb = p.b_tensor ? __fmul_rn(__ldg(p.b_aux), cvt::kInv2688()) : 1.0f;
  unsigned amax_bits = 0u;  // max of the bits of |out| (non-negative floats order as their bits; NaNs above inf)
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    // Elements i and i + 1 of the SM90 accumulator are columns n, n + 1 of one row (checked statically below).
    const int64_t m = m0 + get<0>(tCcC(i)), n = n0 + get<1>(tCcC(i));
    static_assert(decltype(size(acc))::value % 2 == 0, "accumulator pairs");
    if (m >= p.M || n >= p.N) continue;
    const bool pair = n + 1 < p.N;
    float v[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      v[j] = __fmul_rn(__fmul_rn(acc(i + j), ta), tb);
      if (p.bias != nullptr && (j == 0 || pair)) v[j] = __fadd_rn(v[j], __ldg(p.bias + n + j));
    }
    if (p.out_f32) {
      float* o = static_cast<float*>(p.out) + m * p.N + n;
      const uint32_t b0 = dequantize::OutBits<float>(v[0]), b1 = dequantize::OutBits<float>(v[1]);
      if (pair && (p.N % 2 == 0)) {
        *reinterpret_cast<uint2*>(o) = make_uint2(b0, b1);
      } else {
        o[0] = __uint_as_float(b0);
        if (pair) o[1] = __uint_as_float(b1);
      }
      amax_bits = max(amax_bits, b0 & 0x7FFFFFFFu);
      if (pair) amax_bits = max(amax_bits, b1 & 0x7FFFFFFFu);
    } else {
      uint16_t* o = static_cast<uint16_t*>(p.out) + m * p.N + n;
      const uint32_t b0 = dequantize::OutBits<__nv_bfloat16>(v[0]), b1 = dequantize::OutBits<__nv_bfloat16>(v[1]);
      if (pair && (p.N % 2 == 0)) {
        *reinterpret_cast<uint32_t*>(o) = b0 | (b1 << 16);
      } else {
        o[0] = uint16_t(b0);
        if (pair) o[1] = uint16_t(b1);
      }
      amax_bits = max(amax_bits, (b0 << 16) & 0x7FFFFFFFu);
      if (pair) amax_bits = max(amax_bits, (b1 << 16) & 0x7FFFFFFFu);
    }
  }
  if (p.out_amax != nullptr) {
    amax_bits = __reduce_max_sync(0xFFFFFFFFu, amax_bits);
    if ((tid & 31) == 0 && amax_bits != 0u) atomicMax(p.out_amax, amax_bits > 0x7F800000u ? 0x7FC00000u : amax_bits);
  }
#endif
}

}  // namespace gemm
}  // namespace jax_fp4
