"""docs/numerics.md section 5, NVFP4 part: the edge table, with every expected code worked out by hand.

Notation (all fp32, RNE): r6 = fp32(1/6), c = fp32(1/2688), r448 = fp32(1/448), FM = FLT_MAX.
Facts used throughout, each checked by hand (and spelled out in numpy float32 in `test_fp32_facts`):
  r6 = 1/6 + 2**-25/6         => 6*r6 = 1 + 2**-25 rounds to 1.0; 2688*r6 = 448 + 1.3e-5 rounds to 448
                                  (ulp(448) = 2**-15 = 3.05e-5).
  r448 = 1/448 + 1e-10        => 448*r448 = 1 + 4.5e-8 rounds to 1.0; 2688*r448 = 6 + 2.7e-7 rounds UP to
                                  6 + 2**-21 (> 5: E2M1 6, code 7).
  c = 1/2688 + 7e-12          => 2688*c = 1 + 1.9e-8 rounds to 1.0; 448*2688*c rounds to 448.
E2M1 codes: index of {0, .5, 1, 1.5, 2, 3, 4, 6}, sign in bit 3. E4M3 code = (biased exp << 3) | mantissa, bias 7:
  448 = 1.75*2**8 -> 0x7E, 1 -> 0x38, 2**-1 -> 0x30, 2**-2 -> 0x28, 2**-3 -> 0x20, 1.125 -> 0x39,
  0.34375 = 1.375*2**-2 -> 0x2B, subnormals m*2**-9 -> m.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from jax_fp4.reference import nvfp4 as ref_nvfp4

from ._util import FLT_MAX, codes_of, dequantize, dn, p2, quantize, up

NV = jax_fp4.NVFP4()
NAN, INF = np.float32(np.nan), np.float32(np.inf)


WIDTH = 80  # every one-row case is padded to [1, 80] (five blocks) so that they share one compilation


def _blocks(*blocks):
    """One row of 16-blocks, each given as its leading values, padded with +0 (to 5 blocks: zeros change no amax)."""
    row = []
    for b in blocks:
        row += list(b) + [0.0] * (16 - len(b))
    return np.array([row + [0.0] * (WIDTH - len(row))], np.float32)


def _q(x, fmt=NV, axis=-1):
    q = quantize(jnp.asarray(x), fmt, axis=axis)
    return q, codes_of(q.data), codes_of(q.scale), dequantize(q)


def test_fp32_facts():
    """The fp32 roundings the hand computations below rely on."""
    r6, r448, c = np.float32(1 / 6), np.float32(1 / 448), np.float32(1 / 2688)
    assert np.float32(6) * r6 == 1.0 and np.float32(2688) * r6 == 448.0
    assert np.float32(448) * r448 == 1.0 and np.float32(2688) * r448 == up(6.0)
    assert np.float32(2688) * c == 1.0 and np.float32(448 * 2688) * c == 448.0


# ---- the face-value tensor: amax 2688 => S_enc = 2688/2688 = 1, S_dec = 1 -------------------------------------
# A block with amax 6 gets s_b = e4m3(6 * (1 * r6)) = e4m3(1.0) = 1.0 (0x38), e_b = 1/(1*1) = 1: its values are
# rounded at face value. Dequantize: f = (1 * 2688) * c = 1.0, so x_hat = value(q) exactly.
TIES = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -6]
# RNE in code space: ties go to the even index. 0.25 -> 0 (idx 0), 0.75 -> 1.0 (2), 1.25 -> 1.0 (2),
# 1.75 -> 2 (4), 2.5 -> 2 (4), 3.5 -> 4 (6), 5 -> 4 (6); negatives keep the sign bit (-0.25 -> -0 = 0x8).
TIES_CODES = [7, 0, 2, 2, 4, 4, 6, 6, 0x8, 0xA, 0xA, 0xC, 0xC, 0xE, 0xE, 0xF]
MIDS = [6, dn(0.25), up(0.25), dn(0.75), up(0.75), dn(1.25), up(1.25), dn(1.75), up(1.75), dn(2.5), up(2.5),
        dn(3.5), up(3.5), dn(5), up(5), -0.0]
# One fp32 ulp below a midpoint rounds to the lower neighbour, one above to the upper one; -0.0 -> code 0x8.
MIDS_CODES = [7, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 0x8]
# NaN (either sign) -> +6 (0x7) and is ignored by the amax; fp32 subnormals times e_b = 1 stay below 0.25 -> +-0;
# grid values are exact.
MISC = [6, NAN, -NAN, p2(-149), -p2(-130), 0.5, 1, 1.5, 2, 3, 4, -0.5, -1, -1.5, -4, -6]
MISC_CODES = [7, 7, 7, 0, 0x8, 1, 2, 3, 4, 5, 6, 0x9, 0xA, 0xB, 0xE, 0xF]
# Underflowed block: amax 2**-12 -> s_b = e4m3(2**-12 * r6 = 4.1e-5) = 0 (half the smallest E4M3 subnormal is
# 2**-10 = 9.8e-4). e_b = min(1/(0*1), FM) = FM. 2**-12*FM = 8e34 -> +6 (0x7); -2**-13 -> 0xF;
# -2**-127 (subnormal) * FM = -(2 - 2**-23) -> above the 1.75 midpoint -> -2 (0xC); 2**-149*FM = 4.8e-7 -> 0.
UNDER = [p2(-12), -p2(-13), -p2(-127), p2(-149)]
UNDER_CODES = [7, 0xF, 0xC, 0]


def test_face_value_tensor():
    # Block 0 carries the tensor amax 2688: s_b = e4m3(2688 * r6 = 448) = 0x7E, e_b = 1/(448*1) = r448,
    # 2688 * r448 = 6 + 2**-21 -> 6 (code 7); dequantized (448*2688)*c = 448 -> 6 * 448 = 2688 exactly.
    x = _blocks([2688.0], TIES, MIDS, MISC, UNDER)
    q, d, s, xh = _q(x)
    # MISC holds NaNs: the encode uses the finite amax 2688 (NaNs ignored), the carried amax is NaN so that the NaN
    # reaches every decode (docs/numerics.md s6); the face values below decode with the finite amax.
    assert np.isnan(float(q.amax)) and np.isnan(np.asarray(xh)).all()
    q = dataclasses.replace(q, amax=jnp.float32(2688.0))
    xh = dequantize(q)
    assert s.tolist() == [[0x7E, 0x38, 0x38, 0x38, 0x00]]
    expect = [7] + [0] * 15 + TIES_CODES + MIDS_CODES + MISC_CODES + UNDER_CODES + [0] * 12
    assert d.tolist() == [expect]
    xh = np.asarray(xh)
    assert xh[0, 0] == 2688.0
    grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
    face = np.where(np.array(expect[16:64]) & 8, -1, 1) * grid[np.array(expect[16:64]) & 7]
    np.testing.assert_array_equal(xh[0, 16:64], face)  # f = 1: value(q) itself; NaN came back as +6
    # The underflowed block saturates to +-6 codes but dequantizes to 0: f = (0 * 2688) * c = 0.
    np.testing.assert_array_equal(np.abs(xh[0, 64:]), 0.0)


def test_zero_tensor():
    """amax = 0 -> S_enc = 1; s_b = e4m3(0) = 0; e_b = FM; 0*FM = 0 -> code 0, and -0.0*FM = -0 -> code 0x8."""
    x = _blocks([], [0, 0, 0, 0, 0, -0.0])
    q, d, s, xh = _q(x)
    assert float(q.amax) == 0.0 and s.tolist() == [[0] * 5]
    expect = np.zeros((1, WIDTH), int)
    expect[0, 21] = 0x8
    np.testing.assert_array_equal(d, expect)
    np.testing.assert_array_equal(np.asarray(xh), 0.0)  # f = (0 * 0) * c = 0


def test_single_six_s_values():
    """amax A = 2688 * 2**-20 -> S_enc = 2688/A = 2**20 exactly, S_dec = 2**-20; each block holds one +-6*s value.

    b0: [A]: s_b = e4m3(A * (2**20 * r6)) = e4m3(2688 * r6 = 448) = 0x7E; e_b = 2**20 * r448; A*e_b = 2688*r448
        = 6 + 2**-21 -> code 7; x_hat = 6 * ((448 * A) * c) = 6 * 448 * 2**-20 = A.
    b1: [0, 0, 0, -6*2**-23]: s_b = e4m3(6*2**-23 * 2**20 * r6) = e4m3(2**-3) = 0x20; e_b = 1/(2**-3 * 2**-20)
        = 2**23 -> -6 (0xF); x_hat = -6 * (2**-3 * A * c) = -6 * 2**-23.
    b2: [.., 6*2**-28 at 15]: s_b = e4m3(2**-8) = 2 * 2**-9, the E4M3 subnormal code 0x02; e_b = 2**28 -> 6.
    b3: [6*2**-30, -3*2**-30]: s_b = e4m3(2**-10): an exact tie between 0 and 2**-9 -> even -> 0. Then e_b = FM:
        codes 0x7, 0xF, dequantized 0.
    """
    A = np.float32(2688 * 2.0**-20)
    x = _blocks([A], [0, 0, 0, -6 * p2(-23)], [0] * 15 + [6 * p2(-28)], [6 * p2(-30), -3 * p2(-30)])
    q, d, s, xh = _q(x)
    assert float(q.amax) == A
    assert s.tolist() == [[0x7E, 0x20, 0x02, 0x00, 0x00]]
    expect = np.zeros(WIDTH, int)
    expect[[0, 19, 47, 48, 49]] = [7, 0xF, 7, 7, 0xF]
    np.testing.assert_array_equal(d[0], expect)
    want = np.zeros(WIDTH, np.float32)
    want[[0, 19, 47]] = [A, -6 * p2(-23), 6 * p2(-28)]
    np.testing.assert_array_equal(np.asarray(xh)[0], want)


def test_infinities_and_saturation_at_448_6_sdec():
    """amax = inf -> S_enc = 2688/inf = 0 -> S_enc = 1, S_dec = 1: the saturation limit 448*6*S_dec is 2688.

    b0 [inf, -inf, 3000, -1e30, 1, NaN, 0.25, 2**-140]: block amax inf (NaN ignored) -> s_b = e4m3(inf) = 448
      (satfinite, 0x7E), e_b = r448: +-inf -> +-6 (0x7/0xF); 3000*r448 = 6.7 > 6 -> saturates to 0x7;
      -1e30 -> 0xF; 1*r448 = 0.0022 -> 0; NaN -> 0x7; 0.25*r448 -> 0; 2**-140 -> 0.
    b1 [7, 1.5, -4]: s_b = e4m3(7 * r6 = 1.1666667) -> 1.125 (0x39; grid step 0.125, 9.33 steps);
      e_b = 1/1.125 = 0.8888889: 7 -> 6.22 -> 0x7; 1.5 -> 1.333 (> 1.25) -> 1.5 (0x3); -4 -> -3.556 (> 3.5) -> 0xE.
    Dequantize: f = (s_b * inf) * c = inf in both blocks: nonzero codes -> +-inf, zero codes -> 0*inf = NaN.
    """
    x = _blocks([INF, -INF, 3000, -1e30, 1, NAN, 0.25, p2(-140)], [7, 1.5, -4])
    q, d, s, xh = _q(x)
    assert np.isnan(float(q.amax)) and np.isnan(np.asarray(xh)).all()  # the NaN wins (carried amax NaN)
    q = dataclasses.replace(q, amax=jnp.float32(np.inf))  # the encode's amax: inf
    xh = dequantize(q)
    assert s.tolist() == [[0x7E, 0x39, 0, 0, 0]]
    expect = np.zeros(WIDTH, int)
    expect[[0, 1, 2, 3, 5, 16, 17, 18]] = [7, 0xF, 7, 0xF, 7, 7, 3, 0xE]
    np.testing.assert_array_equal(d[0], expect)
    xh = np.asarray(xh)[0]
    assert np.all(np.isposinf(xh[(expect > 0) & (expect < 8)]))
    assert np.all(np.isneginf(xh[expect > 8]))
    assert np.all(np.isnan(xh[expect == 0]))


def test_subnormal_inputs_in_a_normal_block():
    """A = 2688 * 2**-116 -> S_enc = 2**116, S_dec = 2**-116 (b0 = [A]: codes as in test_single_six_s_values).

    b1 = [6*2**-125, 3*2**-128, -3*2**-128, 2**-127, 2**-149] (all but the first are fp32 subnormals):
      s_b = e4m3(6*2**-125 * 2**116 * r6) = e4m3(2**-9) = 0x01 (smallest E4M3 subnormal), e_b = 1/(2**-9 *
      2**-116) = 2**125. Values * 2**125 (exact, no flush): 6 -> 0x7; 3*2**-128 -> 0.375 -> 0.5 (0x1);
      -0.375 -> 0x9; 2**-127 -> 0.25, a tie -> 0; 2**-149 -> 2**-24 -> 0.
      x_hat = value * (2**-9 * A * c) = value * 2**-125: 0.5 -> 2**-126.
    A flush-to-zero implementation would give codes 0 for the subnormals.
    """
    A = np.float32(2688 * 2.0**-116)
    x = _blocks([A], [6 * p2(-125), 3 * p2(-128), -3 * p2(-128), p2(-127), p2(-149)])
    q, d, s, xh = _q(x)
    assert s.tolist() == [[0x7E, 0x01, 0, 0, 0]]
    assert d[0, 16:21].tolist() == [7, 1, 9, 0, 0]
    np.testing.assert_array_equal(np.asarray(xh)[0, 16:19], [6 * p2(-125), p2(-126), -p2(-126)])


def test_tensor_with_subnormal_amax():
    """A = 2**-127 (an fp32 subnormal). 2688/A overflows -> S_enc = min(inf, FM) = FM; S_dec = 1/FM = 2**-128
    (1/((2-2**-23)*2**127) = 2**-128*(1+2**-24+..) rounds to the subnormal 2**-128).

    s_b = e4m3(2**-127 * (FM * r6)): FM*r6 = 5.6713724e37, times 2**-127 = 0.3333333 -> E4M3 step 2**-5 in
      [0.25, 0.5): 10.67 steps -> 11 -> 0.34375 (0x2B).
    e_b = 1/(0.34375 * 2**-128) = 2**133/11 overflows -> min(inf, FM) = FM. Values * FM (exact products):
      2**-127 -> 2 - 2**-23 (> 1.75) -> 2 (0x4); 2**-128 -> 1 - 2**-24 (> 0.75) -> 1 (0x2);
      -3*2**-130 -> -(0.75 - 2**-24) (< 0.75) -> -0.5 (0x9); 2**-149 -> 0; 3*2**-129 -> 1.5 - 2**-23 -> 1.5 (0x3).
    Dequantize decodes with A = max(amax, fp32(2688/FLT_MAX)) (docs/numerics.md s1): S_enc was clamped to FLT_MAX,
      so A = 2688/FLT_MAX is the amax the encode used. f = fl(fl(0.34375 * A) * c), x_hat[0] = 2 * f = 2.0e-39,
      the encode's own value(q) * s_b / S_enc (TE decodes with amax/2688: 1072 * 2**-149 = 1.5e-42). It is not
      ~2**-127 = 5.9e-39 because e_b = 1/(s_b * S_dec) was clamped to FLT_MAX as well (a spec-inherent limit).
    """
    x = _blocks([p2(-127), p2(-128), -3 * p2(-130), p2(-149), 3 * p2(-129)])
    q, d, s, xh = _q(x)
    assert float(q.amax) == p2(-127)
    assert s.tolist() == [[0x2B, 0, 0, 0, 0]]
    assert d[0, :6].tolist() == [4, 2, 9, 0, 3, 0]
    floor = np.float32(2688) / FLT_MAX
    assert np.asarray(xh)[0, 0] == np.float32(2) * ((np.float32(0.34375) * floor) * np.float32(1 / 2688))


def test_block_scale_product_order():
    """s_b = e4m3(block_amax * (S_enc * r6)) with the product S_enc * r6 formed FIRST (docs/numerics.md s1) — the other
    association rounds differently at an E4M3 tie. amax A = 3 -> S_enc = 2688/3 = 896 exactly.
      P = fl(896 * r6): r6 = 1/6 + 1/(3 * 2**26), so 896 * r6 = 149 + 1/3 + 4.45e-6; in units of ulp(149) = 2**-16
        that is 9786709.625 -> 9786710, P = 9786710 * 2**-16 (= 149.33334).
      Block 1 amax a = 9 * 2**-12: exact a * 896/6 = 0.328125 = 21/64, the midpoint of the E4M3 values 0.3125
        (0x2A) and 0.34375 (0x2B). Ours: a * P = 9 * 9786710 * 2**-28 = 0.328125 + 6 * 2**-28 -> fp32 (ulp 2**-25
        = 8 * 2**-28) rounds up to 0.328125 + 2**-25, above the tie -> 0.34375 (0x2B).
      The other order: fl(a * 896) = 1.96875 exactly, * r6 = 0.328125 + 9.8e-9 < half-ulp 1.5e-8 -> 0.328125, an
        exact tie -> even mantissa -> 0.3125 (0x2A).
    Block 0 = [3]: s_b = e4m3(3 * P = 448.00003) = 448 (0x7E).
    """
    x = _blocks([3.0], [9 * p2(-12)])
    q, d, s, _ = _q(x)
    assert float(q.amax) == 3.0
    assert s[0, :2].tolist() == [0x7E, 0x2B]
    P = np.float32(896) * np.float32(1 / 6)
    assert P == np.float32(9786710 * 2.0**-16)  # the fp32 arithmetic above, spelled out


def test_scaling_2d_tile_scale():
    """16x32, 2D scaling: one s_b per 16x16 tile, broadcast to its 16 rows.

    x[5, 0] = 2688 (tensor amax -> S_enc = 1), x[3, 20] = 6, x[0, 16] = 1, x[9, 31] = -0.75.
    Tile 0 amax 2688 -> s_b = 448 (0x7E) on every row; tile 1 amax 6 -> s_b = 1 (0x38) on every row, so x[0, 16]
    is rounded at face value (code 0x2) although its own 1x16 block has amax 1 (1D would give s_b = e4m3(r6) =
    0.171875 = 1.375*2**-3, 0x23, and code 0x7). -0.75 is a tie -> -1 (0xA).
    """
    x = np.zeros((16, 32), np.float32)
    x[5, 0], x[3, 20], x[0, 16], x[9, 31] = 2688, 6, 1, -0.75
    q, d, s, _ = _q(x, jax_fp4.NVFP4(scaling_2d=True))
    np.testing.assert_array_equal(s, np.array([[0x7E, 0x38]] * 16))
    assert (d[5, 0], d[3, 20], d[0, 16], d[9, 31]) == (7, 7, 2, 0xA)
    assert np.count_nonzero(d) == 4
    _, _, s1d, _ = _q(x)  # the 1D scales of the same tensor differ: row 0 block 1 has amax 1
    assert s1d[0, 1] == 0x23


def test_local_1x64_window_floor():
    """NVFP4 1x64 on a 64x64 tensor (both dims % 64 == 0); windows are rows' 64-chunks.

    Row 0, window amax A_w = fp32(1e-13): S_enc,w = 2688 / max(A_w, 1e-12) = 2688/1e-12 = 2.688e15 (the 1e-12
      floor bites; without it S_enc,w = 2.688e16 and s_b would be 448). Block 0 = [1e-13, 0.5e-13, -0.2e-13]:
      s_b = e4m3(1e-13 * (S_enc,w * r6) = 44.8) -> E4M3 step 4 in [32, 64): 11.2 steps -> 44 (1.375*2**5, 0x63).
      block_scale = S_enc,w / 44 = 6.109e13: 1e-13 -> 6.109 -> 6 (0x7); 0.5e-13 -> 3.05 -> 3 (0x5);
      -0.2e-13 -> -1.222 (< 1.25) -> -1 (0xA). x_hat = value * 44 / S_enc,w: 6 -> 9.82e-14.
    Row 1, A_w = 2688 -> S_enc,w = 1: block 0 = [2688] -> s_b = 448 (0x7E), code 7; block 1 = the tie block
      (amax 6 -> s_b = 1, block_scale 1, face value).
    Row 2 and the rest: zeros -> A_w = 0 -> S_enc,w = 1, s_b = 0, block_scale = 0, codes 0.
    """
    x = np.zeros((64, 64), np.float32)
    x[0, :3] = [1e-13, 0.5e-13, -0.2e-13]
    x[1, 0] = 2688
    x[1, 16:32] = TIES
    q, d, s, xh = _q(x, jax_fp4.NVFP4(local_1x64=True))
    assert q.amax is None and q.window_amax.shape == (64, 1)
    assert np.asarray(q.window_amax)[:3, 0].tolist() == [np.float32(1e-13), 2688.0, 0.0]
    assert s[0].tolist() == [0x63, 0, 0, 0] and s[1].tolist() == [0x7E, 0x38, 0, 0]
    assert d[0, :3].tolist() == [7, 5, 0xA] and d[1, 0] == 7 and d[1, 16:32].tolist() == TIES_CODES
    assert np.count_nonzero(s[2:]) == 0 and np.count_nonzero(d[2:]) == 0
    s_enc_w = np.float32(2688) / np.float32(1e-12)
    np.testing.assert_allclose(np.asarray(xh)[0, 0], 6 * 44 / s_enc_w, rtol=1e-6)


def test_global_encode_scale_rule():
    """S_enc = min(2688/amax, FM), and 1 when amax == 0 or 2688/amax == 0 (amax = inf), as a function."""
    got = np.asarray(ref_nvfp4.global_encode_scale(jnp.array([2688.0, 0.0, np.inf, p2(-127), 1.0, FLT_MAX])))
    # 2688/FM = 7.9e-36 (normal) and 2688/1 = 2688.
    assert got.tolist() == [1.0, 1.0, 1.0, FLT_MAX, 2688.0, np.float32(2688) / FLT_MAX]


def test_rows_not_multiple_of_128_swizzled():
    """x[3, 32]: compact scales [3, 2] -> swizzled/padded [128, 4]. x[0, 0] = 2688 (S_enc = 1) and
    x[r, 16c] = 6 * 2**(r + 2c - 4) elsewhere -> s_b = 2**(r + 2c - 4) exactly (6 * r6 rounds to 1):
      S = [[448, 2**-2], [2**-3, 2**-1], [2**-2, 1]] = [[0x7E, 0x28], [0x20, 0x30], [0x28, 0x38]].
    Swizzled flat index of S[i, j] (i < 32, j < 4) = i*16 + j; every other one of the 512 bytes is 0 (padding).
    """
    x = np.zeros((3, 32), np.float32)
    for r in range(3):
        for c in range(2):
            x[r, 16 * c] = 6 * 2.0 ** (r + 2 * c - 4)
    x[0, 0] = 2688
    q = jax_fp4.quantize(jnp.asarray(x), NV, scale_layout="swizzled")
    assert q.scale.shape == (128, 4) and q.scale.dtype == jnp.float8_e4m3fn
    flat = codes_of(q.scale).reshape(-1)
    want = np.zeros(512, int)
    want[[0, 1, 16, 17, 32, 33]] = [0x7E, 0x28, 0x20, 0x30, 0x28, 0x38]
    np.testing.assert_array_equal(flat, want)
    compact = codes_of(jax.jit(jax_fp4.unswizzle_scales)(q).scale)
    np.testing.assert_array_equal(compact, [[0x7E, 0x28], [0x20, 0x30], [0x28, 0x38]])


EMPTY_FORMATS = [NV, jax_fp4.NVFP4(scaling_2d=True), jax_fp4.NVFP4(rht=True), jax_fp4.NVFP4(local_1x64=True),
                 jax_fp4.MXFP8(), jax_fp4.MXFP8(element="e5m2")]


@pytest.mark.parametrize("fmt", EMPTY_FORMATS, ids=repr)
@pytest.mark.parametrize("shape,axis", [((0, 64), -1), ((64, 0), -1), ((0, 64), 0), ((64, 0), 0)])
def test_empty_tensors(fmt, shape, axis):
    """Empty inputs are legal (docs/numerics.md s3): empty data and scales of the documented shapes, amax of
    nothing = 0.

    (2D with a zero-length block axis once raised ZeroDivisionError in nvfp4._tile_amax_2d: reshape(-1, 16, 0).)
    Scale matrix [rows, cols] and its padded/swizzled shape [round_up(rows, 128), round_up(cols, 4)]:
      NVFP4 (block axis last): (0,64)/-1 -> data (0,64), scales (0,4) -> (0,4); (64,0)/-1 -> (64,0) -> (128,0);
        (0,64)/0 -> data (64,0), scales (64,0) -> (128,0); (64,0)/0 -> data (0,64), scales (0,4) -> (0,4).
      MXFP8 (data keeps x's shape; columnwise [M/32, K] viewed as [K, M/32]): (0,64)/-1 -> scales (0,2) -> (0,4);
        (64,0)/-1 -> (64,0) -> (128,0); (0,64)/0 -> scales (0,64), viewed (64,0) -> (128,0); (64,0)/0 -> (2,0),
        viewed (0,2) -> (0,4).
    """
    nv = isinstance(fmt, jax_fp4.NVFP4)
    x = jnp.zeros(shape, jnp.float32)
    q = quantize(x, fmt, axis=axis)
    moved = shape[::-1] if (nv and axis == 0) else shape
    assert q.data.shape == moved
    if nv:
        assert q.scale.shape == moved[:-1] + (moved[-1] // 16,)
    else:
        assert q.scale.shape == tuple(d // 32 if i == axis % 2 else d for i, d in enumerate(shape))
    if nv and fmt.local_1x64:
        assert q.window_amax.shape == moved[:-1] + (moved[-1] // 64,)
    elif nv:
        assert float(q.amax) == 0.0
    swizzled = {((0, 64), -1): (0, 4), ((64, 0), -1): (128, 0), ((0, 64), 0): (128, 0), ((64, 0), 0): (0, 4)}
    assert jax_fp4.swizzle_scales(q).scale.shape == swizzled[(shape, axis)]
    assert dequantize(q).shape == shape
