"""docs/numerics.md section 5, MXFP8 part: E8M0 codes 0, 1, 0xFD, 0xFE (0xFF), e4m3/e5m2 max values, ties, inf/NaN,
subnormals. Every expected code is worked out by hand below.

Rule (s2): v = block_amax * r where r = fp32(1/max_norm); e = exponent bits of v, +1 when the mantissa is
nonzero, except when they are 0xFE, or 0 with mantissa <= 0x400000; inf -> 0xFE, NaN -> 0xFF, 0 -> 0.
Data: q = satfinite_rne(x * 2**(127 - e)), the multiplier being 2**-127 for e = 254.
Facts: r448 = fp32(1/448) = 1/448 + 1e-10, so 448 * r448 = 1 + 4.5e-8 rounds to exactly 1.0 (half-ulp of 1 is
6e-8); fp32(1/57344) = r448 * 2**-7 (57344 = 448 * 128), so 57344 * fp32(1/57344) = 1.0 too.
E4M3 code = (biased exp << 3) | mant, bias 7, max 448 = 0x7E, NaN 0x7F; subnormals m * 2**-9 -> m.
E5M2 code = (biased exp << 2) | mant, bias 15, max 57344 = 0x7B; subnormals m * 2**-16 -> m; NaN: 0x7F (what CUDA's
cvt gives: cuda_fp8.hpp canonicalises NaN to 0x7FFFFFFF, whose top mantissa bits give 0x7E | 3; ml_dtypes and XLA
give 0x7E, see test_crosscheck).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import jax_fp4
from jax_fp4.reference import mxfp8 as ref_mxfp8

from ._util import FLT_MAX, codes_of, dequantize, dn, p2, quantize, up

NAN, INF = np.float32(np.nan), np.float32(np.inf)


def _rows(rows):
    """[len(rows), 32]: each row one 32-block given by its leading values, padded with +0."""
    x = np.zeros((len(rows), 32), np.float32)
    for i, r in enumerate(rows):
        x[i, : len(r)] = r
    return x


# (leading values of the block, expected E8M0 code, expected leading data codes)
E4M3_ROWS = [
    # zeros: amax 0 -> v = 0 -> e = 0; 0 * 2**127 = 0.
    ([], 0x00, []),
    # amax 448 -> v = 448 * r448 = 1.0 -> e = 127, multiplier 1: face values.
    # 1.0625 tie 1.0|1.125 -> 1.0 (even mantissa 0, 0x38); one ulp above -> 1.125 (0x39); 1.1875 tie 1.125|1.25
    # -> 1.25 (0x3A); one ulp below -> 0x39; 3*2**-10 tie 2**-9|2*2**-9 -> 0x02; 2**-10 tie 0|2**-9 -> 0; one ulp
    # above -> 0x01; 432 tie 416|448 -> 448 (0x7E); 400 tie 384|416 -> 384 (0x7C); 15*2**-10 tie between the
    # largest subnormal 7*2**-9 (0x07) and the smallest normal 2**-6 (0x08) -> 0x08; -0.0 -> 0x80; NaN of either
    # sign -> 0x7F; -448 -> 0xFE.
    ([448, -448, 1.0625, up(1.0625), 1.1875, dn(1.1875), 3 * p2(-10), p2(-10), up(p2(-10)), 432, 400,
      15 * p2(-10), -0.0, NAN, -NAN],
     0x7F, [0x7E, 0xFE, 0x38, 0x39, 0x3A, 0x39, 0x02, 0x00, 0x01, 0x7E, 0x7C, 0x08, 0x80, 0x7F, 0x7F]),
    # amax 2**-120: v = 2**-120 * r448 = 1.14 * 2**-129, an fp32 subnormal with mantissa 0x124925 <= 0x400000
    # -> e = 0 (code 0), multiplier 2**127 (exact, subnormal inputs kept): 2**-120 -> 128 (2**7, 0x70);
    # 2**-130 -> 0.125 (0x20); 5*2**-137 -> 2.5 * 2**-9, tie -> 2*2**-9 (0x02); -2**-149 -> -2**-22 -> -0 (0x80).
    ([p2(-120), p2(-130), 5 * p2(-137), -p2(-149)], 0x00, [0x70, 0x20, 0x02, 0x80]),
    # amax 448*2**-127: v = 2**-127 * (1 + 4.5e-8) -> the subnormal 0x400000 * 2**-149 (excess 0.19 units): mantissa
    # == 0x400000 is not bumped -> e = 0; 448 * 2**-127 * 2**127 = 448 (0x7E).
    ([448 * p2(-127)], 0x00, [0x7E]),
    # amax 672*2**-127 = 1.5 * 448 * 2**-127: v -> 0x600000 * 2**-149 (mantissa > 0x400000) -> e = 1 (code 1);
    # data * 2**126: 336, a tie 320|352 -> 320 (1.25 * 2**8, 0x7A).
    ([672 * p2(-127)], 0x01, [0x7A]),
    # amax 448*2**-126: v = 2**-126 exactly (normal, exponent bits 1, mantissa 0) -> e = 1; 448 -> 0x7E.
    ([448 * p2(-126)], 0x01, [0x7E]),
    # amax 448*2**100: v = 2**100 -> e = 227 (0xE3); 448 -> 0x7E, -2**100 -> -1 (0xB8).
    ([448 * np.float32(2.0**100), -np.float32(2.0**100)], 0xE3, [0x7E, 0xB8]),
    # amax FLT_MAX = (2 - 2**-23) * 2**127: v = FLT_MAX * r448 = 1.14 * 2**119 -> exponent bits 246, mantissa
    # nonzero -> e = 247 (0xF7), the largest code finite data can reach (0xFD needs amax = 448 * 2**126 > FLT_MAX).
    # FLT_MAX * 2**-120 = 256 - 2**-16 -> E4M3 step 16 in [128, 256) -> 256 (0x78); -FLT_MAX -> 0xF8.
    ([FLT_MAX, -FLT_MAX], 0xF7, [0x78, 0xF8]),
    # inf: amax inf -> e = 0xFE, multiplier 2**-127 (the fp32 subnormal): +-inf saturate to +-448 (0x7E/0xFE);
    # 2**126 -> 0.5 (0x30); 1.0 -> 2**-127 -> 0; NaN -> 0x7F; FLT_MAX -> 2 - 2**-23 -> 2.0 (0x40).
    ([INF, -INF, p2(126), 1.0, NAN, FLT_MAX], 0xFE, [0x7E, 0xFE, 0x30, 0x00, 0x7F, 0x40]),
    # all NaN: the amax ignores NaN -> amax 0 -> e = 0 (so E8M0 0xFF never comes from data); NaN * 2**127 -> 0x7F.
    ([NAN] * 32, 0x00, [0x7F] * 32),
]

E5M2_ROWS = [
    # amax 57344 -> v = 1.0 -> e = 127. 1.125 tie 1.0|1.25 -> 1.0 (0x3C); 1.375 tie 1.25|1.5 -> 1.5 (0x3E);
    # 2**-16 -> 0x01; 3*2**-17 tie -> 2*2**-16 (0x02); 2**-17 tie -> 0; 53248 tie 49152|57344 -> 49152 (0x7A);
    # NaN -> 0x7F; -0.0 -> 0x80; -57344 -> 0xFB.
    ([57344, -57344, 1.125, 1.375, p2(-16), 3 * p2(-17), p2(-17), 53248, NAN, -0.0],
     0x7F, [0x7B, 0xFB, 0x3C, 0x3E, 0x01, 0x02, 0x00, 0x7A, 0x7F, 0x80]),
    # inf -> e = 0xFE: +-inf -> +-57344 (0x7B/0xFB); 1.0 * 2**-127 -> 0.
    ([INF, -INF, 1.0], 0xFE, [0x7B, 0xFB, 0x00]),
    # amax 57344*2**-130: v = 2**-130 = 0x80000 * 2**-149 (<= 0x400000) -> e = 0; 57344 * 2**-3 = 7168
    # (1.75 * 2**12 -> (27 << 2) | 3 = 0x6F).
    ([57344 * p2(-130)], 0x00, [0x6F]),
]


def _check(rows, fmt):
    x = _rows([r[0] for r in rows])
    q = quantize(jnp.asarray(x), fmt)
    d, s = codes_of(q.data), codes_of(q.scale)
    for i, (_vals, e, want) in enumerate(rows):
        assert s[i, 0] == e, (i, hex(s[i, 0]), hex(e))
        assert d[i, : len(want)].tolist() == want, (i, [hex(c) for c in d[i, : len(want)]])
        np.testing.assert_array_equal(d[i, len(want):], 0)
    return x, q


def test_e4m3_edge_rows():
    x, q = _check(E4M3_ROWS, jax_fp4.MXFP8())
    xh = np.asarray(dequantize(q))
    # Face-value row: x_hat = value(q) * 2**0.
    np.testing.assert_array_equal(xh[1, :12], [448, -448, 1, 1.125, 1.25, 1.125, 2 * p2(-9), 0, p2(-9), 448, 384,
                                               p2(-6)])
    assert np.isnan(xh[1, 13]) and np.isnan(xh[1, 14]) and np.signbit(xh[1, 12])
    # Code-0 row: 128 * 2**-127 = 2**-120 and 0.125 * 2**-127 = 2**-130 (a subnormal output, not flushed).
    np.testing.assert_array_equal(xh[2, :3], [p2(-120), p2(-130), 2 * p2(-9) * p2(-127)])
    # FLT_MAX rounds up to 256 * 2**120 = 2**128 (e rounds up, then the data rounds up too): the decode saturates
    # the finite code to +-FLT_MAX (TE's gives inf; docs/numerics.md section 2).
    assert xh[7, 0] == FLT_MAX and xh[7, 1] == -FLT_MAX
    # inf row: 448 * 2**127 (the encoding of inf: its rounding interval [432, inf) * 2**127 lies beyond FLT_MAX)
    # stays inf; 0.5 * 2**127 = 2**126; 2.0 * 2**127 = 2**128 (FLT_MAX's code; lower midpoint 1.9375 * 2**127 <=
    # FLT_MAX) saturates to FLT_MAX.
    assert np.isposinf(xh[8, 0]) and np.isneginf(xh[8, 1]) and xh[8, 2] == p2(126) and xh[8, 5] == FLT_MAX
    # bf16 output: 2**128's interval reaches below bf16 max (0x7F7F): saturated; f16: far beyond 65504, inf.
    b = np.asarray(dequantize(q, jnp.bfloat16)).view(np.uint16)
    assert b[7, 0] == 0x7F7F and b[7, 1] == 0xFF7F and b[8, 5] == 0x7F7F and b[8, 0] == 0x7F80
    b = np.asarray(dequantize(q, jnp.float16)).view(np.uint16)
    assert b[7, 0] == 0x7C00 and b[7, 1] == 0xFC00 and b[8, 5] == 0x7C00


def test_e5m2_edge_rows():
    x, q = _check(E5M2_ROWS, jax_fp4.MXFP8(element="e5m2"))
    xh = np.asarray(dequantize(q))
    np.testing.assert_array_equal(xh[0, :8], [57344, -57344, 1, 1.5, p2(-16), 2 * p2(-16), 0, 49152])
    assert xh[2, 0] == 7168 * p2(-127)


def test_e8m0_rule():
    """float_to_e8m0 on chosen v (the rule as a function; 0xFD/0xFE/0xFF are unreachable from finite data)."""
    v = [0.0, p2(-149), p2(-127), up(p2(-127)), p2(-126), up(p2(-126)), 1.0, 1.5, 1.5 * p2(125), p2(126),
         up(p2(126)), p2(127), FLT_MAX, INF, NAN]
    # 0 -> 0; subnormals with mantissa <= 0x400000 -> 0; 0x400001 -> 1; 2**-126 -> 1; above -> 2; 1.0 -> 127;
    # 1.5 -> 128; 1.5 * 2**125 -> 252 + 1 = 0xFD; 2**126 -> 0xFD; above -> 0xFE; exponent bits 0xFE are never
    # bumped: 2**127 and FLT_MAX -> 0xFE; inf -> 0xFE; NaN -> 0xFF.
    want = [0, 0, 0, 1, 1, 2, 127, 128, 0xFD, 0xFD, 0xFE, 0xFE, 0xFE, 0xFE, 0xFF]
    assert np.asarray(ref_mxfp8.e8m0_from_float(jnp.asarray(np.array(v, np.float32)))).tolist() == want


def test_dequantize_extreme_scale_codes():
    """x_hat = float(q) * 2**(e - 127) for E8M0 codes 0xFD, 0xFE, 0xFF and 0 (via a hand-built QuantizedArray).

    Data row [1.0 (0x38), 448 (0x7E), 2**-9 (0x01), -0 (0x80)]:
      0xFD: 2**126, 448 * 2**126 -> inf (its lower midpoint 432 * 2**126 > FLT_MAX), 2**117, -0.
      0xFE: 2**127, inf, 2**118, -0.   0xFF: NaN everywhere.
      0x00: 2**-127 (subnormal), 448 * 2**-127 = 1.75 * 2**-119, 2**-136 (subnormal, not flushed), -0.
    """
    data = np.zeros((4, 32), np.uint8)
    data[:, :4] = [0x38, 0x7E, 0x01, 0x80]
    scale = np.array([[0xFD], [0xFE], [0xFF], [0x00]], np.uint8)
    q = jax_fp4.QuantizedArray(jnp.asarray(data.view(jnp.float8_e4m3fn)), jnp.asarray(scale.view(jnp.float8_e8m0fnu)),
                               None, None, fmt=jax_fp4.MXFP8(), axis=-1)
    xh = np.asarray(dequantize(q))
    inf = np.inf
    np.testing.assert_array_equal(xh[0, :4], [p2(126), inf, p2(117), 0])
    np.testing.assert_array_equal(xh[1, :4], [p2(127), inf, p2(118), 0])
    assert np.isnan(xh[2]).all()
    np.testing.assert_array_equal(xh[3, :4], [p2(-127), 448 * p2(-127), p2(-136), 0])
    assert np.signbit(xh[[0, 1, 3], 3]).all()
