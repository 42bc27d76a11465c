// Host check of cpp/common/e2m1.cuh against the threshold definitions of docs/numerics.md (E2M1 RNE and stochastic
// rounding, as in jax_fp4/reference). Built and run by tests/test_e2m1_exhaustive.py; prints "ok N" or the first
// mismatches and exits 1.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>

#include "common/e2m1.cuh"

using namespace jax_fp4::e2m1;

// RNE onto {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code; |v| > 5 and inf -> 6; NaN -> +6; sign kept.
static uint32_t RneDefinition(float v) {
  const float a = std::fabs(v);
  if (a != a) return 7u;
  const uint32_t sign = (Bits(v) >> 28) & 8u;
  return sign | ((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f));
}

// t = |v| + (r / 256) * step(|v|) (one rounding), rounded down onto the grid, clamped to 6; sign kept; NaN -> +6.
static uint32_t SrDefinition(float v, uint32_t r) {
  const float a = std::fabs(v);
  if (a != a) return 7u;
  const float step = a < 2.0f ? 0.5f : (a < 4.0f ? 1.0f : 2.0f);
  volatile float prod = static_cast<float>(r) * 0.00390625f * step;  // exact
  const float t = a + prod;
  const uint32_t idx = (t >= 0.5f) + (t >= 1.0f) + (t >= 1.5f) + (t >= 2.0f) + (t >= 3.0f) + (t >= 4.0f) + (t >= 6.0f);
  return ((Bits(v) >> 28) & 8u) | idx;
}

// One element through the encoder. RNE takes y unclamped (as the sm_90 kernels do); SR takes Clamp6(y). The sign
// comes from Clamp6(y) (NaN -> +6: the GPU's NaN products are positive).
static uint32_t Fast(float y, bool sr, uint32_t r) {
  const float c = Clamp6(y);
  const uint32_t m = sr ? MagnitudeSr(c, r) : MagnitudeRne(y);
  const float cs[8] = {c, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  return (m - kMagic) | Signs8(cs);
}

int main() {
  uint64_t bad = 0, n = 0;
  // RNE: every fp32 bit pattern.
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; ++u) {
    const float y = Float(static_cast<uint32_t>(u));
    const uint32_t want = RneDefinition(y), got = Fast(y, false, 0);
    ++n;
    if (got != want && bad++ < 10) std::printf("RNE 0x%08llx: got %x want %x\n", (unsigned long long)u, got, want);
  }
  // SR: every random byte for the patterns whose low 12 mantissa bits are 0, 1 or 0xFFF (all exponents, signs).
  for (uint64_t hi = 0; hi < (1ull << 20); ++hi) {
    for (uint32_t lo : {0u, 1u, 0xFFFu}) {
      const float y = Float(static_cast<uint32_t>(hi << 12) | lo);
      for (uint32_t r = 0; r < 256; ++r) {
        const uint32_t want = SrDefinition(y, r), got = Fast(y, true, r);
        ++n;
        if (got != want && bad++ < 20) std::printf("SR 0x%08x r=%u: got %x want %x\n", Bits(y), r, got, want);
      }
    }
  }
  // Pack8 on random values and multipliers, against the per-element definitions.
  std::mt19937 gen(1234);
  std::uniform_int_distribution<uint32_t> bits;
  for (int it = 0; it < 2000000; ++it) {
    float v[8];
    for (float& f : v) f = Float(bits(gen) & 0xC1FFFFFFu) * 8.0f;  // exponents near 0 plus specials
    const float mult = Float(0x3E000000u + (bits(gen) & 0x01FFFFFFu));
    const uint32_t rnd[4] = {bits(gen), bits(gen), bits(gen), bits(gen)};
    for (int sr = 0; sr < 2; ++sr) {
      const uint32_t got = sr ? Pack8<true>(v, mult, rnd, 8) : Pack8<false>(v, mult, rnd, 8);
      uint32_t want = 0;
      for (int j = 0; j < 8; ++j) {
        const float y = v[j] * mult;
        want |= (sr ? SrDefinition(y, RandomByte(rnd, 8 + j)) : RneDefinition(y)) << (4 * j);
      }
      ++n;
      if (got != want && bad++ < 30) std::printf("Pack8 sr=%d: got %08x want %08x\n", sr, got, want);
    }
  }
  if (bad) {
    std::printf("FAILED %llu of %llu\n", (unsigned long long)bad, (unsigned long long)n);
    return 1;
  }
  std::printf("ok %llu\n", (unsigned long long)n);
  return 0;
}
