// Host check of dequantize::WindowDivisor (cpp/dequantize/args.cuh): for every distinct significand of an NVFP4 1x64
// block value x = value(q) * s_b (q an E2M1 magnitude, s_b a positive finite E4M3 scale) and every fp32 divisor
// significand b in [1, 2), the Markstein sequence q0 = RN(x * RN(1 / b)), q1 = RN(q0 + (x - q0 * b) * RN(1 / b))
// equals the correctly rounded x / b. Scaling x and b by powers of two scales every step exactly while the
// intermediates stay normal, which WindowDivisor::Safe guarantees; so this covers every window it accepts.
//
// Build and run: g++ -O2 -mfma -std=c++17 -o /tmp/markstein tools/dev/kernel_check/markstein_check.cc && /tmp/markstein
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <set>

static float Bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static uint32_t U(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

static float E4m3(uint32_t c) {  // positive codes 1..0x7E
  const uint32_t e = c >> 3, m = c & 7;
  return e ? std::ldexp(1.0f + m / 8.0f, int(e) - 7) : std::ldexp(m / 8.0f, -6);
}

int main() {
  const float mags[] = {0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  std::set<uint32_t> sig;  // significands of x, as x scaled into [1, 2)
  for (float q : mags)
    for (uint32_t c = 1; c <= 0x7E; ++c) {
      int e;
      const float m = std::frexp(q * E4m3(c), &e);  // q * s_b is exact (2 x 4 significant bits)
      sig.insert(U(2.0f * m));
    }
  std::printf("%zu distinct block-value significands\n", sig.size());
  uint64_t checked = 0, bad = 0;
  for (uint32_t bm = 0; bm < (1u << 23); ++bm) {
    const float b = Bits(0x3F800000u | bm), rcp = 1.0f / b;
    for (uint32_t xs : sig) {
      for (float x : {Bits(xs), -Bits(xs)}) {
        const float q0 = x * rcp;
        const float q1 = std::copysign(std::fma(std::fma(-q0, b, x), rcp, q0), x);
        const float want = x / b;
        ++checked;
        if (U(q1) != U(want) && bad++ < 10) std::printf("x=%a b=%a got %a want %a\n", x, b, q1, want);
      }
    }
  }
  // Zeros keep their sign.
  for (float x : {0.0f, -0.0f}) {
    const float b = 3.0f, rcp = 1.0f / b, q0 = x * rcp;
    const float q1 = std::copysign(std::fma(std::fma(-q0, b, x), rcp, q0), x);
    bad += U(q1) != U(x / b);
  }
  std::printf("%llu quotients checked, %llu differ from x / b\n", (unsigned long long)checked, (unsigned long long)bad);
  return bad != 0;
}
