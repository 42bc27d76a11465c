"""`jax_fp4.fake_quantize`: the forward is dequantize(quantize(x)) bit for bit, the gradient is straight-through
(optionally zero where the quantizer clipped), under jit, vmap and inside a training step (CPU, small shapes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from jax_fp4 import MXFP8, NVFP4

FORMATS = [NVFP4(), NVFP4(scaling_2d=True), NVFP4(rht=True), NVFP4(local_1x64=True), MXFP8(), MXFP8(element="e5m2")]


def _x(shape, seed, scale=3.0, dtype=jnp.float32):
    return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale).astype(dtype)


def _bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
@pytest.mark.parametrize("axis", [-1, 0])
def test_forward_is_the_round_trip_and_gradient_is_straight_through(fmt, axis):
    x = _x((64, 64), 0, dtype=jnp.bfloat16)
    y = jax.jit(lambda x: jax_fp4.fake_quantize(x, fmt, axis=axis))(x)
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(_bits(y), _bits(jax_fp4.dequantize(jax_fp4.quantize(x, fmt, axis=axis), x.dtype)))
    ct = _x((64, 64), 1, dtype=jnp.bfloat16)
    g = jax.jit(jax.grad(lambda x: jnp.sum(jax_fp4.fake_quantize(x, fmt, axis=axis).astype(jnp.float32)
                                           * ct.astype(jnp.float32))))(x)
    np.testing.assert_array_equal(_bits(g), _bits(ct))


@pytest.mark.parametrize("fmt", [NVFP4(), MXFP8(), MXFP8(element="e5m2")], ids=repr)
def test_clip_gradient_zero_exactly_where_clipped(fmt):
    """Blocks whose largest element does not fit the largest code after the scale rounding saturate: those
    elements (|x| > |y| at the largest code) get a zero gradient, every other element the cotangent."""
    x = _x((32, 64), 2)
    x = x.at[:, 5].set(1.9 * 2.0 ** jnp.arange(32))  # MXFP8: 1.9 * 2^k with a power-of-two scale can saturate
    ct = _x((32, 64), 3)
    q = jax_fp4.quantize(x, fmt)
    y = jax_fp4.dequantize(q, x.dtype)
    codes = np.abs(np.asarray(q.data.astype(jnp.float32)))
    clipped = (codes == fmt.max_value) & (np.abs(np.asarray(x)) > np.abs(np.asarray(y)))
    if isinstance(fmt, NVFP4):  # E4M3 block scales round to nearest: some block maxima exceed 6 * s_b
        assert clipped.any()  # (MXFP8's E8M0 scale is rounded up from amax / max: nothing clips)
    g = jax.grad(lambda x: jnp.sum(jax_fp4.fake_quantize(x, fmt, clip_gradient=True) * ct))(x)
    np.testing.assert_array_equal(np.asarray(g), np.where(clipped, 0.0, np.asarray(ct)))
    g0 = jax.grad(lambda x: jnp.sum(jax_fp4.fake_quantize(x, fmt) * ct))(x)
    np.testing.assert_array_equal(np.asarray(g0), np.asarray(ct))


def test_stochastic_rounding_needs_a_key_and_uses_it():
    fmt = NVFP4(stochastic_rounding=True)
    x = _x((16, 32), 4)
    with pytest.raises(ValueError, match="key"):
        jax_fp4.fake_quantize(x, fmt)
    a, b = (jax_fp4.fake_quantize(x, fmt, key=jax.random.key(k)) for k in (1, 2))
    assert not np.array_equal(np.asarray(a), np.asarray(b))
    g = jax.grad(lambda x: jax_fp4.fake_quantize(x, fmt, key=jax.random.key(1)).sum())(x)
    np.testing.assert_array_equal(np.asarray(g), np.ones_like(x))


def test_vmap_and_errors():
    xs = _x((3, 16, 32), 5)
    ys = jax.vmap(lambda x: jax_fp4.fake_quantize(x, MXFP8()))(xs)
    np.testing.assert_array_equal(np.asarray(ys[2]), np.asarray(jax_fp4.fake_quantize(xs[2], MXFP8())))
    with pytest.raises(ValueError, match="RHT|rht"):
        jax_fp4.fake_quantize(xs[0], NVFP4(rht=True), clip_gradient=True)
    with pytest.raises(TypeError, match="Format"):
        jax_fp4.fake_quantize(xs[0], "nvfp4")
    with pytest.raises(ValueError, match="multiple of the block size"):
        jax_fp4.fake_quantize(_x((16, 24), 6), NVFP4())


def test_quantization_aware_training_step():
    """A QAT step through fake_quantize of weights and activations: finite gradients, the loss decreases."""
    w = _x((64, 32), 7, scale=0.1)
    x = _x((32, 64), 8)
    target = jnp.tanh(x @ _x((64, 32), 9, scale=0.1))

    def loss(w):
        xq = jax_fp4.fake_quantize(x, MXFP8())
        wq = jax_fp4.fake_quantize(w, NVFP4(), axis=0)
        return jnp.mean((jnp.tanh(xq @ wq) - target) ** 2)

    step = jax.jit(lambda w: w - 0.5 * jax.grad(loss)(w))
    l0 = float(loss(w))
    for _ in range(20):
        w = step(w)
    assert np.isfinite(l0) and float(loss(w)) < 0.8 * l0
