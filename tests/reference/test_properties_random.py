"""Randomised properties: jit == eager and vmap == loop (bit-exact, hypothesis-drawn shapes), stochastic rounding
statistics, and error bounds of dequantize(quantize(x)) derived from the formats."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_fp4

from ._util import codes_of, dequantize, quantize

NV = jax_fp4.NVFP4()
FORMATS = {
    "nvfp4": NV, "nvfp4_2d": jax_fp4.NVFP4(scaling_2d=True), "nvfp4_rht": jax_fp4.NVFP4(rht=True),
    "nvfp4_sr": jax_fp4.NVFP4(stochastic_rounding=True), "nvfp4_1x64": jax_fp4.NVFP4(local_1x64=True),
    "mxfp8": jax_fp4.MXFP8(), "mxfp8_e5m2": jax_fp4.MXFP8(element="e5m2"),
}
DTYPES = ["float32", "bfloat16", "float16"]
SEEDS = st.integers(0, 2**31)


@st.composite
def cases(draw):
    """(format name, shape, axis, dtype, seed): rank 1-3, block-multiple block axis, odd / empty other axes."""
    name = draw(st.sampled_from(sorted(FORMATS)))
    fmt = FORMATS[name]
    if name == "nvfp4_1x64":  # block axis and flattened rest both multiples of 64: keep it [0|64, 64]
        axis = draw(st.sampled_from([-1, 0]))
        return name, (draw(st.sampled_from([0, 64])), 64), axis, draw(st.sampled_from(DTYPES)), draw(SEEDS)
    rank = draw(st.integers(2 if name == "nvfp4_2d" else 1, 3))
    dims = [draw(st.sampled_from([0, 1, 3, 5])) for _ in range(rank)]
    axis = draw(st.integers(-rank, rank - 1))
    dims[axis] = fmt.block_size * draw(st.sampled_from([0, 1, 2]))
    if name == "nvfp4_2d":  # the flattened non-block axes must be a multiple of 16 (0 allowed)
        other = 1 if axis % rank == 0 else 0
        dims[other] = draw(st.sampled_from([0, 16, 32]))
    return name, tuple(dims), axis, draw(st.sampled_from(DTYPES)), draw(SEEDS)


def _x(shape, dtype, seed):
    r = np.random.default_rng(seed)
    x = r.standard_normal(shape) * 10.0 ** r.uniform(-3, 3, shape[:1] + (1,) * (len(shape) - 1))
    return jnp.asarray(x.astype(np.float32)).astype(dtype)


def _assert_same(a, b):
    """Bit-exact equality of two QuantizedArrays (codes, amax bits) and of their metadata."""
    assert (a.fmt, a.axis, a.scale_layout) == (b.fmt, b.axis, b.scale_layout)
    np.testing.assert_array_equal(codes_of(a.data), codes_of(b.data))
    np.testing.assert_array_equal(codes_of(a.scale), codes_of(b.scale))
    for u, v in ((a.amax, b.amax), (a.window_amax, b.window_amax)):
        assert (u is None) == (v is None)
        if u is not None:
            np.testing.assert_array_equal(np.asarray(u).view(np.uint32), np.asarray(v).view(np.uint32))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.sampled_from(["compact", "swizzled"]))
def test_jit_equals_eager(case, layout_):
    name, shape, axis, dtype, seed = case
    fmt = FORMATS[name]
    x, key = _x(shape, dtype, seed), jax.random.key(seed)
    eager = jax_fp4.quantize(x, fmt, axis=axis, key=key, scale_layout=layout_)
    jitted = quantize(x, fmt, axis=axis, key=key, scale_layout=layout_)
    _assert_same(eager, jitted)
    out = jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(jax_fp4.dequantize(eager, out)).view(f"u{out.itemsize}"),
                                  np.asarray(dequantize(jitted, out)).view(f"u{out.itemsize}"))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(1, 3))
def test_vmap_equals_loop(case, batch):
    """vmap over a leading batch axis == the per-example quantize (each example has its own amax and key)."""
    name, shape, axis, dtype, seed = case
    fmt = FORMATS[name]
    xs = jnp.stack([_x(shape, dtype, seed + i) for i in range(batch)])
    keys = jax.random.split(jax.random.key(seed), batch)
    f = functools.partial(jax_fp4.quantize, fmt=fmt, axis=axis)
    vq = jax.jit(jax.vmap(lambda x, k: f(x, key=k)))(xs, keys)
    vdq = jax.jit(jax.vmap(jax_fp4.dequantize))(vq)
    for i in range(batch):
        qi = quantize(xs[i], fmt, axis=axis, key=keys[i])
        one = jax.tree.map(lambda leaf, i=i: leaf[i], vq)
        _assert_same(one, qi)
        np.testing.assert_array_equal(np.asarray(vdq[i]), np.asarray(dequantize(qi)))


# ---- stochastic rounding: deterministic per key, unbiased in expectation -----------------------------------------
def _face_value_tensor(rng):
    """x[16, 32], |x| <= 6 with a +-6 in every block: amax 6 -> S_enc = 448, s_b = 448, e_b = 1 and the dequantize
    factor (448 * 6) * fp32(1/2688) = 1 (see test_edge_sr_rht): quantize / dequantize act on x at face value."""
    x = rng.uniform(-6, 6, (16, 32)).astype(np.float32)
    for r in range(16):
        x[r, r], x[r, r + 16] = 6, -6
    return x


def test_sr_deterministic_per_key_and_key_dependent(rng):
    x = jnp.asarray(_face_value_tensor(rng))
    fmt = FORMATS["nvfp4_sr"]
    a = codes_of(quantize(x, fmt, key=jax.random.key(1)).data)
    b = codes_of(quantize(x, fmt, key=jax.random.key(1)).data)
    c = codes_of(quantize(x, fmt, key=jax.random.key(2)).data)
    np.testing.assert_array_equal(a, b)
    # 512 values, most strictly between grid points: two keys agree on all of them with negligible probability.
    assert (a != c).mean() > 0.1


def test_sr_is_unbiased(rng):
    """Mean over N keys of dequantize(quantize_SR(x)) is x within a derived bound.

    At face value, with a = |x| in [g, g + step) (step = 0.5 / 1 / 2 by binade), SR returns g + step * B where
    B = 1 iff r >= ceil(256 * (1 - p)), p = (a - g) / step, r uniform on 0..255: P(B = 1) = floor(256 p) / 256
    (exactly p when 256 p is an integer), so the bias is in (-step/256, 0]. By Hoeffding, the mean of N i.i.d.
    B's deviates from P(B = 1) by more than t with probability <= 2 exp(-2 N t**2); with n = 512 elements and a
    total failure probability delta = 1e-6, t = sqrt(ln(2 n / delta) / (2 N)) = 0.102 for N = 1000. Bound per
    element: |mean - x| <= step * (t + 1/256) (+ 1e-6 relative for fp32 summation).
    Teeth: round-to-nearest has |q(x) - x| up to step/2 > step * 0.106 on this data, so a biased rounding fails.
    """
    x = _face_value_tensor(rng)
    n_keys = 1000
    fmt = FORMATS["nvfp4_sr"]
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), n_keys)
    mean = jax.jit(lambda x, ks: jnp.mean(jax.vmap(lambda k: dequantize(jax_fp4.quantize(x, fmt, key=k)))(ks), 0))
    m = np.asarray(mean(jnp.asarray(x), keys))
    a = np.abs(x)
    step = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))
    t = math.sqrt(math.log(2 * x.size / 1e-6) / (2 * n_keys))
    bound = step * (t + 1 / 256) + 1e-6 * a
    assert np.all(np.abs(m - x) <= bound), np.max(np.abs(m - x) / bound)
    rne = np.asarray(dequantize(quantize(jnp.asarray(x), NV)))
    assert np.any(np.abs(rne - x) > bound)


# ---- error bounds of dequantize(quantize(x)) on Gaussian data -------------------------------------------------
def _block_amax(x, axis, size):
    """Per-element amax of its 1 x size block along `axis`, by numpy."""
    y = np.moveaxis(np.abs(x), axis, -1)
    b = y.reshape(*y.shape[:-1], -1, size).max(-1, keepdims=True)
    return np.moveaxis(np.broadcast_to(b, b.shape[:-1] + (size,)).reshape(y.shape), -1, axis)


def _tile_amax(x):
    """Per-element amax of its 16x16 tile of a 2-D x (the same tiles for both orientations)."""
    r, c = x.shape
    t = np.abs(x).reshape(r // 16, 16, c // 16, 16).max((1, 3))
    return np.repeat(np.repeat(t, 16, 0), 16, 1)


@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_2d", "nvfp4_1x64"])
def test_nvfp4_error_bound(rng, name, axis):
    """|x_hat - x| <= g(a_max) * (a_b / 6) * (17/16) * (1 + 1e-5) per element, a_b = its block (2D: tile) amax.

    Derivation: s_b = RNE_e4m3(a_b * S_enc / 6) is an E4M3 normal on this data (a_b / amax > 1e-3), so it is
    within a factor (1 +- 2**-4) of a_b * S_enc / 6; the scaled value a = |x| * e_b = |x| * S_enc / s_b then lies
    below a_max = |x| * 6 / (a_b * (1 - 2**-4)) <= 6.4. E2M1 RNE error in a-units is <= 0.25 below 2, <= 0.5
    below 4, <= 1 up to 6, and a - 6 <= 0.4 when saturating: g(a) = 0.25 / 0.5 / 1 by binade, evaluated at a_max
    (g is non-decreasing). One a-unit is 1/e_b = s_b * S_dec <= (a_b / 6)(1 + 2**-4) in x-units; the dequantize
    factor (s_b * amax) * fp32(1/2688) equals s_b * S_dec up to a few fp32 roundings (the 1e-5 slack). 1x64: the
    same with S_enc,w. The bound is attained (a = 5 -> error 1 a-unit), not tuned.
    """
    fmt = FORMATS[name]
    x = np.random.default_rng(rng.integers(2**32)).standard_normal((128, 128)).astype(np.float32)
    xh = np.asarray(dequantize(quantize(jnp.asarray(x), fmt, axis=axis)))
    ab = _tile_amax(x) if fmt.scaling_2d else _block_amax(x, axis, 16)
    a_max = np.abs(x) * 6 / (ab * (1 - 2.0**-4))
    g = np.where(a_max <= 2, 0.25, np.where(a_max <= 4, 0.5, 1.0))
    bound = g * ab / 6 * (17 / 16) * (1 + 1e-5)
    err = np.abs(xh - x)
    assert np.all(err <= bound), np.max(err / bound)
    assert np.max(err / bound) > 0.5  # the bound is not vacuous on Gaussian data


@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("name", ["mxfp8", "mxfp8_e5m2"])
def test_mxfp8_error_bound(rng, name, axis):
    """|x_hat - x| <= u * |x| + (h / max_norm) * 2 * a_b * (1 + 1e-6) per element.

    Derivation: the scale 2**(e-127) is v = a_b * fp32(1/max) rounded up to a power of two, so it is
    < 2 * a_b / max * (1 + 2**-23); scaled values |x| * 2**(127-e) <= max (no saturation of finite data). RNE to
    E4M3 (E5M2) has relative error <= u = 2**-4 (2**-3) in the normal range and absolute error <= h = 2**-10
    (2**-17), half the smallest subnormal, below it; multiplying back by the scale is exact.
    """
    fmt = FORMATS[name]
    u, h = (2.0**-4, 2.0**-10) if fmt.element == "e4m3" else (2.0**-3, 2.0**-17)
    x = np.random.default_rng(rng.integers(2**32)).standard_normal((64, 128)).astype(np.float32)
    xh = np.asarray(dequantize(quantize(jnp.asarray(x), fmt, axis=axis)))
    ab = _block_amax(x, axis, 32)
    bound = u * np.abs(x) + h / fmt.max_value * 2 * ab * (1 + 1e-6)
    err = np.abs(xh - x)
    assert np.all(err <= bound), np.max(err / bound)
    assert np.max(err / bound) > 0.5
