// Block-scaled GEMM for Hopper (sm_90a): out[m, n] = ta * tb * sum_w fa[m, w] fb[n, w] sum_{k in w} va[m, k] vb[n, k]
// + bias[n] (docs/kernels/gemm.md, docs/numerics.md section 7). Both operands are K-major ("TN"): packed E2M1 codes
// with E4M3 1x16 block scales (NVFP4) or E4M3 / E5M2 codes with E8M0 1x32 block scales (MXFP8), compact scales.
//
// One CTA of 384 threads computes a 128 x 256 output tile (NVFP4 1x64: 128 x 128), one decode warpgroup and two
// consumer warpgroups (168 registers a thread):
//  * staging (both roles, OperandPart and Staging): a thread copies the packed codes of its half rows of K-tile
//    kt + kRing - 1 (+ 1 for consumers) into a shared-memory ring with cp.async (each thread reads back only its own
//    copies: no barrier between copy and use), loads the block scales of the next K-tile into registers, and decodes
//    its half rows of a K-tile (value(code) * block scale, exact bfloat16, gemm/gemm_decode.cuh) into the
//    128-byte-swizzled stage the WGMMAs read, once the consumers have released that stage (mbarrier `empty`); a
//    proxy fence and an arrival on the stage's `full` mbarrier (all 384 threads) publish it. The decode warpgroup
//    (Producer) stages B, each consumer thread one half row of A in its own warpgroup's 64-row slice.
//  * the consumer warpgroups (Consumer; CuTe's SM90 64x256x16 / 64x128x16 bf16 WGMMA atom, fp32 accumulators) wait on
//    `full`, issue the K-tile's four k16 WGMMAs, stage their A half rows of the next K-tile meanwhile, keep one batch
//    in flight and release the stage of the previous K-tile on `empty`. NVFP4 1x64: each K-tile is one window; its
//    WGMMAs accumulate into a zeroed temporary fragment, promoted into the accumulator as
//    acc = fma(tmp * fa[m], fb[n], acc) (fa = RN(1 / S_enc,w) of row m's window, written per stage by the thread
//    staging the row's half 0); the other consumer warpgroup's WGMMAs run meanwhile.
//  * the epilogue (Epilogue, the consumer threads) multiplies by ta then tb (NVFP4 tensor scales amax * fp32(1/2688),
//    1 otherwise), adds the bias, casts (RNE, canonical NaN) and stores with bounds checks; with kEmitAmax it folds
//    max |out| (NaN if any output is NaN) into out_amax with a warp reduction and an atomicMax on the float bits
//    (zeroed on the stream first).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/memory_sm80.h>

#include "common/convert.cuh"
#include "dequantize/decode.cuh"
#include "gemm/gemm_decode.cuh"

namespace jax_fp4 {
namespace gemm {

constexpr int kBM = 128, kBK = 64;
constexpr int kDecoders = 128;              // one decode warpgroup (threads 0..127)
constexpr int kThreads = kDecoders + 256;   // then two consumer warpgroups (168 registers a thread)
constexpr int kRing = 3;                    // K-tiles of packed codes a thread has in the ring

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

// A half row of an operand that a thread stages: its codes, block scales and (1x64) window amax at K-tile 0, and
// whether the row exists. Computed once; a K-tile's accesses then only add the K-tile's offset.
struct HalfRow {
  const uint8_t* data;   // code byte of k = 32 * half
  const uint8_t* scale;  // its block scale
  const float* aux;      // the row's window amax (1x64)
  bool in;               // row < rows (else every code and scale reads as zero)
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

// 16-byte chunks of codes in one half row of a K-tile.
template <bool kFp4>
constexpr int kChunks = kFp4 ? 1 : 2;

// Starts the copy of K-tile kt's codes of a half row into `dst` (chunk j at dst + j * kStride: the ring keeps chunk j of
// every half row together, so that threads with consecutive half rows touch consecutive 16 bytes), zero-filling rows and blocks outside the operand (K is a multiple of the
// block size: a block is entirely inside or outside). NVFP4 rows are 16-byte aligned only when K % 32 == 0 (`al16`);
// otherwise two 8-byte copies. k = kt * 64 + 32 * half (+ 16) stays below 2^31 (the handler checks K).
template <bool kFp4, int kStride>
__device__ __forceinline__ void CopyCodes(uint4* dst, const HalfRow& h, int K, int kt, int half, bool al16) {
  using cutlass::arch::CacheOperation;
  const int k0 = kt * kBK + 32 * half;
  if constexpr (kFp4) {
    const bool in0 = h.in && k0 < K, in1 = h.in && k0 + 16 < K;
    const uint8_t* src = h.data + kt * (kBK / 2);
    if (al16) {
      cutlass::arch::cp_async_zfill<16, CacheOperation::Global>(dst, in0 ? src : h.data, in0);
    } else {
      cutlass::arch::cp_async_zfill<8, CacheOperation::Always>(dst, in0 ? src : h.data, in0);
      cutlass::arch::cp_async_zfill<8, CacheOperation::Always>(reinterpret_cast<uint8_t*>(dst) + 8,
                                                               in1 ? src + 8 : h.data, in1);
    }
  } else {
    const bool in = h.in && k0 < K;
    const uint8_t* src = in ? h.data + kt * kBK : h.data;
    cutlass::arch::cp_async_zfill<16, CacheOperation::Global>(dst, src, in);
    cutlass::arch::cp_async_zfill<16, CacheOperation::Global>(dst + kStride, src + 16, in);
  }
}

// The block scales (and 1x64 window amax) of a half row's K-tile kt; zero outside the operand.
struct Scales {
  uint32_t s[2];  // NVFP4: the two 16-blocks' E4M3 codes; MXFP8: s[0] the E8M0 code
  float w;        // window amax (1x64)
};

template <bool kFp4, bool kLocal>
__device__ __forceinline__ Scales LoadScales(const HalfRow& h, int K, int kt, int half) {
  Scales r{{0u, 0u}, 0.0f};
  const int k0 = kt * kBK + 32 * half;
  if constexpr (kFp4) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (h.in && k0 + 16 * j < K) r.s[j] = __ldg(h.scale + kt * (kBK / 16) + j);
    }
    if constexpr (kLocal) r.w = h.in ? __ldg(h.aux + kt) : 0.0f;
  } else {
    if (h.in && k0 < K) r.s[0] = __ldg(h.scale + kt * (kBK / 32));
  }
  return r;
}

// Decodes a half row's codes (chunks at src + j * kStride) under its scales into row `row` of stage `st`.
template <bool kFp4, int kStride, typename STensor>
__device__ __forceinline__ void DecodeHalfRow(const uint4* src, const Scales& sc, STensor& s, int row, int half,
                                              int st, int e5m2) {
  if constexpr (kFp4) {
    const uint4 c = src[0];
    const Fp4Regs r{{make_uint2(c.x, c.y), make_uint2(c.z, c.w)}, {sc.s[0], sc.s[1]}};
    DecodeFp4(r, s, row, half, st);
  } else {
    const Fp8Regs r{{src[0], src[kStride]}, sc.s[0]};
    if (e5m2) {
      DecodeFp8<__NV_E5M2>(r, s, row, half, st);
    } else {
      DecodeFp8<__NV_E4M3>(r, s, row, half, st);
    }
  }
}

// The half rows of one operand that a thread stages: kN of them (none for kN = 0), half-row indices first + kStep i
// of the tile's 2 * rows (row index / 2, codes 32 (index % 2) .. + 31 of each K-tile). Copy starts the cp.async of a
// K-tile's codes into the ring slot `ring` ([chunk][half row], kStride half rows); LoadScales fetches a K-tile's
// block scales into `nxt`, Advance makes them current; Decode writes the current K-tile into a stage (and, 1x64,
// each row's window factor into `factors` from the half-0 thread).
template <bool kFp4, bool kLocal, int kN, int kStride>
struct OperandPart {
  static constexpr int kSize = kN > 0 ? kN : 1;
  HalfRow h[kSize];
  int idx[kSize];
  Scales cur[kSize], nxt[kSize];

  __device__ __forceinline__ void Init(const uint8_t* data, const uint8_t* scale, const float* aux, int64_t row0,
                                       int64_t rows, int64_t K, int first, int step) {
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      idx[i] = first + step * i;
      h[i] = MakeHalfRow<kFp4>(data, scale, aux, row0 + (idx[i] >> 1), rows, K, idx[i] & 1);
    }
  }
  __device__ __forceinline__ void Copy(uint4* ring, int K, int kt, bool al16) const {
#pragma unroll
    for (int i = 0; i < kN; ++i) CopyCodes<kFp4, kStride>(ring + idx[i], h[i], K, kt, idx[i] & 1, al16);
  }
  __device__ __forceinline__ void LoadScales(int K, int kt) {
#pragma unroll
    for (int i = 0; i < kN; ++i) nxt[i] = gemm::LoadScales<kFp4, kLocal>(h[i], K, kt, idx[i] & 1);
  }
  __device__ __forceinline__ void Advance() {
#pragma unroll
    for (int i = 0; i < kN; ++i) cur[i] = nxt[i];
  }
  template <typename STensor>
  __device__ __forceinline__ void Decode(const uint4* ring, STensor& s, float* factors, int st, int e5m2) const {
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const int row = idx[i] >> 1, half = idx[i] & 1;
      DecodeHalfRow<kFp4, kStride>(ring + idx[i], cur[i], s, row, half, st, e5m2);
      if constexpr (kLocal) {
        if (half == 0) factors[row] = WindowFactor(cur[i].w);
      }
    }
  }
};

// Shared-memory tile layouts: K-major, 128-byte swizzle (the WGMMA descriptor's SW128 K-major mode).
using SmemAtom = cute::GMMA::Layout_K_SW128_Atom<cute::bfloat16_t>;
template <int kRows, int kStages>
using SmemLayout = decltype(cute::tile_to_shape(SmemAtom{}, cute::make_shape(cute::Int<kRows>{}, cute::Int<kBK>{},
                                                                              cute::Int<kStages>{})));

// The tile configuration. Plain products: 128 x 256 tiles (each consumer warpgroup 64 x 256, 128 accumulators a
// thread), three bf16 stages. 1x64: 128 x 128 tiles (the accumulator comes with a fragment of window sums) and four
// stages. Shared memory: bf16 stages, the code ring, the 1x64 factors, the mbarriers (<= 227 KB).
template <bool kFp4A, bool kFp4B, bool kLocal>
struct Config {
  static constexpr int kBN = kLocal ? 128 : 256;
  static constexpr int kStages = kLocal ? 4 : 3;
  // Who stages what (half-row indices; A has 2 * kBM, B 2 * kBN): each consumer thread ct stages A's half row ct (a
  // row of its own warpgroup's slice), between issuing one K-tile's WGMMAs and waiting for them; each decoder thread
  // t stages B's half rows t + 128 i.
  static constexpr int kDecoderB = 2 * kBN / kDecoders;
  static constexpr int kFactorRows = kLocal ? kBN : 1;
  using LayoutA = SmemLayout<kBM, kStages>;
  using LayoutB = SmemLayout<kBN, kStages>;
  using Atom = std::conditional_t<kLocal,
                                  cute::SM90_64x128x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>,
                                  cute::SM90_64x256x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>>;
  using TiledMma = decltype(cute::make_tiled_mma(Atom{}, cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  struct alignas(1024) SharedStorage {
    cute::array_aligned<cute::bfloat16_t, cute::cosize_v<LayoutA>, 1024> a;
    cute::array_aligned<cute::bfloat16_t, cute::cosize_v<LayoutB>, 1024> b;
    uint4 codes_a[kRing][kChunks<kFp4A>][2 * kBM];  // the packed codes of kRing K-tiles: [chunk][half row]
    uint4 codes_b[kRing][kChunks<kFp4B>][2 * kBN];
    float fa[kStages][kLocal ? kBM : 1];  // 1x64 window decode factors of the stage's rows
    float fb[kStages][kFactorRows];
    uint64_t full[kStages];   // decoders -> consumers: the stage holds its K-tile
    uint64_t empty[kStages];  // consumers -> decoders: the stage's readers are done
  };
  static_assert(sizeof(SharedStorage) <= 227 * 1024, "shared memory");
};

// Output tile order: groups of kGroupM tile rows walked column by column, so neighbouring CTAs share A and B tiles
// in L2.
constexpr int kGroupM = 8;

// The staging of K-tiles into stages, shared by both roles: Copy starts K-tile kt's codes (a cp.async group per
// K-tile, empty past the last, kRing - 1 K-tiles ahead of the decode); Decode decodes it once the consumers released
// its stage and publishes it with a proxy fence and an arrival on the stage's `full` barrier.
template <class Cfg, class TensorA, class TensorB>
struct Staging {
  using Barrier = cutlass::arch::ClusterBarrier;
  typename Cfg::SharedStorage& smem;
  TensorA& sA;  // (BM, BK, stage)
  TensorB& sB;  // (BN, BK, stage)
  const Params& p;
  int KT, K;
  bool al16;

  template <class PA, class PB>
  __device__ __forceinline__ void Copy(const PA& pa, const PB& pb, int kt) const {
    if (kt < KT) {
      const int c = kt % kRing;
      pa.Copy(&smem.codes_a[c][0][0], K, kt, al16);
      pb.Copy(&smem.codes_b[c][0][0], K, kt, al16);
    }
    cutlass::arch::cp_async_fence();
  }
  // Decodes K-tile kt (its codes: the cp.async group kt, with kRing - 1 later groups allowed outstanding).
  template <class PA, class PB>
  __device__ __forceinline__ void Decode(PA& pa, PB& pb, int kt, int st, uint32_t empty_phase) const {
    cutlass::arch::cp_async_wait<kRing - 1>();
    Barrier::wait(&smem.empty[st], empty_phase);
    const int c = kt % kRing;
    pa.Decode(&smem.codes_a[c][0][0], sA, smem.fa[st], st, p.a_e5m2);
    pb.Decode(&smem.codes_b[c][0][0], sB, smem.fb[st], st, p.b_e5m2);
    cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> visible to the WGMMA (async proxy) reads
    Barrier::arrive(&smem.full[st]);
  }
};

// Producer (the decode warpgroup, thread tid < kDecoders): B's half rows tid + 128 i of the tile at column n0,
// kRing - 1 K-tiles of codes in flight.
template <bool kFp4A, bool kFp4B, bool kLocal, class Stage>
__device__ __forceinline__ void Producer(const Stage& stage, int64_t n0, int tid) {
  using Cfg = Config<kFp4A, kFp4B, kLocal>;
  const Params& p = stage.p;
  OperandPart<kFp4A, kLocal, 0, 2 * kBM> pa;
  OperandPart<kFp4B, kLocal, Cfg::kDecoderB, 2 * Cfg::kBN> pb;
  pb.Init(p.b, p.b_scale, p.b_aux, n0, p.N, p.K, tid, kDecoders);
#pragma unroll
  for (int j = 0; j < kRing - 1; ++j) stage.Copy(pa, pb, j);
  pb.LoadScales(stage.K, 0);
  pb.Advance();
  int st = 0;
  uint32_t phase = 1;  // a fresh mbarrier's preceding phase (parity 1) counts as complete: the first pass is free
  for (int kt = 0; kt < stage.KT; ++kt) {
    stage.Copy(pa, pb, kt + kRing - 1);
    if (kt + 1 < stage.KT) pb.LoadScales(stage.K, kt + 1);
    stage.Decode(pa, pb, kt, st, phase);
    pb.Advance();
    if (++st == Cfg::kStages) st = 0, phase ^= 1u;
  }
}

// Epilogue (consumer thread ct): * ta, * tb, + bias, cast, bounds-checked store of the tile at (m0, n0), amax. acc: the
// thread's fp32 accumulator fragment; tCcC: the tile-relative (m, n) of each of its elements.
template <class Acc, class Coord>
__device__ __forceinline__ void Epilogue(const Params& p, const Acc& acc, const Coord& tCcC, int64_t m0, int64_t n0,
                                         int ct) {
  using namespace cute;
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
    if ((ct & 31) == 0 && amax_bits != 0u) atomicMax(p.out_amax, amax_bits > 0x7F800000u ? 0x7FC00000u : amax_bits);
  }
}

// Consumer (consumer thread ct of the two WGMMA warpgroups): stages A's half row ct of the tile at (m0, n0) one K-tile
// ahead of the WGMMAs, accumulates the tile in fp32 and hands it to the Epilogue.
template <bool kFp4A, bool kFp4B, bool kLocal, class Stage>
__device__ __forceinline__ void Consumer(const Stage& stage, int64_t m0, int64_t n0, int ct) {
  using namespace cute;
  using Cfg = Config<kFp4A, kFp4B, kLocal>;
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kBN = Cfg::kBN, kStages = Cfg::kStages;
  const Params& p = stage.p;
  auto& smem = stage.smem;
  const int KT = stage.KT;
  OperandPart<kFp4A, kLocal, 1, 2 * kBM> pa;
  OperandPart<kFp4B, kLocal, 0, 2 * kBN> pb;
  pa.Init(p.a, p.a_scale, p.a_aux, m0, p.M, p.K, ct, 0);
#pragma unroll
  for (int j = 0; j < kRing - 1; ++j) stage.Copy(pa, pb, j);
  pa.LoadScales(stage.K, 0);
  pa.Advance();
  int dst = 0;           // the stage of the K-tile decoded next
  uint32_t dphase = 1;   // its `empty` parity
  auto decode_next = [&](int kt) {  // decodes K-tile kt, loads K-tile kt + 1's scales
    if (kt + 1 < KT) pa.LoadScales(stage.K, kt + 1);
    stage.Decode(pa, pb, kt, dst, dphase);
    pa.Advance();
    if (++dst == kStages) dst = 0, dphase ^= 1u;
  };
  stage.Copy(pa, pb, kRing - 1);
  decode_next(0);

  typename Cfg::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(ct);
  Tensor tCsA = thr_mma.partition_A(stage.sA);     // (MMA, MMA_M, MMA_K, stage)
  Tensor tCsB = thr_mma.partition_B(stage.sB);     // (MMA, MMA_N, MMA_K, stage)
  Tensor tCrA = thr_mma.make_fragment_A(tCsA);     // smem descriptors
  Tensor tCrB = thr_mma.make_fragment_B(tCsB);
  Tensor acc = partition_fragment_C(tiled_mma, Shape<Int<kBM>, Int<kBN>>{});  // (MMA, MMA_M, MMA_N) fp32
  Tensor cC = make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{});
  Tensor tCcC = thr_mma.partition_C(cC);           // the (m, n) of each accumulator element, tile-relative
  clear(acc);

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

  // Iteration kt: wait for K-tile kt's stage, issue its WGMMAs, stage K-tile kt + 1 (its codes were copied
  // kRing - 1 K-tiles earlier; the copy of K-tile kt + kRing starts here), then release the stage of K-tile kt - 1.
  int st = 0;
  uint32_t phase = 0;
  if constexpr (!kLocal) {
    int prev = 0;
    for (int kt = 0; kt < KT; ++kt) {
      stage.Copy(pa, pb, kt + kRing);
      Barrier::wait(&smem.full[st], phase);
      mma(st, acc, false);
      if (kt + 1 < KT) decode_next(kt + 1);
      warpgroup_wait<1>();  // the batch of K-tile kt - 1 is complete (kt's may still run)
      if (kt > 0) Barrier::arrive(&smem.empty[prev]);
      prev = st;
      if (++st == kStages) st = 0, phase ^= 1u;
    }
  } else {
    // 1x64: each K-tile's window sums go to a zeroed temporary fragment and are complete (warpgroup_wait<0>) before
    // their promotion acc = fma(tmp * fa[m], fb[n], acc); the other consumer warpgroup's WGMMAs fill the gap.
    auto tmp = make_fragment_like(acc);
    for (int kt = 0; kt < KT; ++kt) {
      stage.Copy(pa, pb, kt + kRing);
      Barrier::wait(&smem.full[st], phase);
      mma(st, tmp, true);
      if (kt + 1 < KT) decode_next(kt + 1);
      warpgroup_wait<0>();
      warpgroup_fence_operand(tmp);
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i) {
        const int m = get<0>(tCcC(i)), n = get<1>(tCcC(i));
        acc(i) = __fmaf_rn(__fmul_rn(tmp(i), smem.fa[st][m]), smem.fb[st][n], acc(i));
      }
      Barrier::arrive(&smem.empty[st]);
      if (++st == kStages) st = 0, phase ^= 1u;
    }
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  Epilogue(p, acc, tCcC, m0, n0, ct);
}

template <bool kFp4A, bool kFp4B, bool kLocal>
__global__ void __launch_bounds__(kThreads, 1) GemmKernel(const Params p) {
#if defined(__CUDA_ARCH__) && defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  using namespace cute;
  using Cfg = Config<kFp4A, kFp4B, kLocal>;
  using Barrier = cutlass::arch::ClusterBarrier;
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
  const int tid = threadIdx.x;
  const int KT = int((p.K + kBK - 1) / kBK);
  const int K = int(p.K);

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&smem.full[s], kThreads);
      Barrier::init(&smem.empty[s], kThreads - kDecoders);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  const Staging<Cfg, decltype(sA), decltype(sB)> stage{smem, sA, sB, p, KT, K, K % 32 == 0};
  if (tid < kDecoders) {
    Producer<kFp4A, kFp4B, kLocal>(stage, n0, tid);
    return;
  }
  Consumer<kFp4A, kFp4B, kLocal>(stage, m0, n0, tid - kDecoders);
#endif
}

}  // namespace gemm
}  // namespace jax_fp4
