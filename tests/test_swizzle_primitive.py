"""`jf4_swizzle` / `jf4_unswizzle` and the public `swizzle_scales` / `unswizzle_scales` (CPU: the reference lowering).

* swizzle == `jax_fp4.reference.layout.swizzle` (and an explicit loop over docs/numerics.md's index formula) per matrix,
  with leading batch dimensions, padding rows / columns (zeros), empty matrices;
* unswizzle(swizzle(s)) == s and swizzle(unswizzle(sw)) == sw (exact inverses) for every 8-bit dtype;
* public swizzle_scales / unswizzle_scales == `jax_fp4.reference.swizzle_scales` / `unswizzle_scales` for every
  format and orientation; vmap; trace-time errors.
The CUDA kernels against these bits: tests/test_dequantize_kernels.py (gpu marker).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _quantize_util import assert_leaf_bits, random_input

import jax_fp4
from jax_fp4 import MXFP8, NVFP4, reference
from jax_fp4._src.primitives.swizzle import (
    BYTE_DTYPES,
    padded_shape,
    reference_swizzle,
    swizzle,
    swizzle_p,
    unswizzle,
    unswizzle_p,
)
from jax_fp4.reference import layout

SHAPES = [(3, 2), (128, 4), (130, 5), (320, 8), (64, 70), (1, 1), (256, 68), (0, 4), (5, 0), (2, 3, 130, 6), (0, 7, 3),
          (2, 0, 3)]


def _loop_swizzle(s):
    """docs/numerics.md section 3 index formula, element by element (independent of the reshape/transpose reference)."""
    r, c = s.shape
    rp, cp = padded_shape(r, c)
    flat = np.zeros(rp * cp, s.dtype)
    for i in range(r):
        for j in range(c):
            flat[((i // 128) * (cp // 4) + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4] = s[i, j]
    return flat.reshape(rp, cp)


def _bytes(rng, shape, dtype=jnp.uint8):
    b = jnp.asarray(rng.integers(0, 256, shape, dtype=np.uint8))
    return b if jnp.dtype(dtype) == jnp.uint8 else jax.lax.bitcast_convert_type(b, dtype)


def _u8(a):
    a = jnp.asarray(a)
    return np.asarray(a if a.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(a, jnp.uint8))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_swizzle_equals_reference_and_inverts(rng, shape):
    s = _bytes(rng, shape)
    sw = jax.jit(swizzle)(s)
    assert sw.shape == (*shape[:-2], *padded_shape(*shape[-2:])) and sw.dtype == s.dtype
    batch = math.prod(shape[:-2])
    m = _u8(s).reshape(batch, *shape[-2:])
    got = _u8(sw).reshape(batch, *sw.shape[-2:])
    for b in range(m.shape[0]):
        np.testing.assert_array_equal(got[b], _loop_swizzle(m[b]), err_msg=f"matrix {b}")
        if m[b].size:
            np.testing.assert_array_equal(got[b], _u8(layout.swizzle(jnp.asarray(m[b]))))
    back = jax.jit(lambda a: unswizzle(a, *shape[-2:]))(sw)
    np.testing.assert_array_equal(_u8(back), _u8(s))


@pytest.mark.parametrize("dtype", BYTE_DTYPES, ids=lambda d: d.name)
def test_exact_inverses_for_every_byte_dtype(rng, dtype):
    """unswizzle(swizzle(s)) == s; swizzle(unswizzle(sw)) == sw for sw with zero padding (the swizzle's image)."""
    s = _bytes(rng, (2, 200, 7), dtype)
    sw = swizzle(s)
    assert_leaf_bits(unswizzle(sw, 200, 7), s, f"{dtype.name} unswizzle(swizzle(s))")
    assert_leaf_bits(swizzle(unswizzle(sw, 200, 7)), sw, f"{dtype.name} swizzle(unswizzle(sw))")
    # the padding rows (200..255) and column (7) hold zero bytes: == the swizzle of the zero-padded matrix
    np.testing.assert_array_equal(_u8(sw)[0], _loop_swizzle(np.pad(_u8(s)[0], ((0, 56), (0, 1)))))


def test_vmap_moves_the_batch_to_a_leading_dimension(rng):
    a = _bytes(rng, (5, 3, 130, 6))
    got = jax.vmap(swizzle, in_axes=1)(a)
    assert got.shape == (3, 5, 256, 8)
    for i in range(3):
        np.testing.assert_array_equal(_u8(got[i]), _u8(reference_swizzle(a[:, i])))
    back = jax.vmap(lambda s: unswizzle(s, 130, 6), in_axes=0, out_axes=2)(got)
    np.testing.assert_array_equal(_u8(back), _u8(jnp.moveaxis(a, 1, 2)))
    assert "jf4_swizzle" in str(jax.make_jaxpr(jax.vmap(swizzle))(a))


# ---- public swizzle_scales / unswizzle_scales ------------------------------------------------------------------------
CASES = [(NVFP4(), (3, 40, 32), -1), (NVFP4(), (48, 20), 0), (NVFP4(local_1x64=True), (64, 128), 0),
         (MXFP8(), (64, 5, 32), 0), (MXFP8(), (7, 96), -1), (MXFP8(element="e5m2"), (3, 64, 32), 1),
         (NVFP4(), (0, 64), -1), (MXFP8(), (64, 0), 0)]


@pytest.mark.parametrize("fmt,shape,axis", CASES, ids=str)
def test_public_swizzle_scales_equal_reference(rng, fmt, shape, axis):
    x = jnp.asarray(random_input(rng, shape, jnp.float32))
    q = jax_fp4.quantize(x, fmt, axis=axis)
    s = jax.jit(jax_fp4.swizzle_scales)(q)
    assert s.scale_layout == "swizzled"
    assert_leaf_bits(s.scale, reference.swizzle_scales(q.scale, fmt, q.axis), "swizzle_scales")
    assert_leaf_bits(s.scale, jax_fp4.quantize(x, fmt, axis=axis, scale_layout="swizzled").scale, "vs quantize")
    u = jax.jit(jax_fp4.unswizzle_scales)(s)
    assert u.scale_layout == "compact"
    assert_leaf_bits(u.scale, q.scale, "unswizzle_scales(swizzle_scales(q))")
    assert_leaf_bits(u.scale, reference.unswizzle_scales(s.scale, fmt, q.compact_scale_shape(), q.axis), "vs ref")
    assert jax_fp4.swizzle_scales(s) is s and jax_fp4.unswizzle_scales(q) is q
    jaxpr = str(jax.make_jaxpr(jax_fp4.swizzle_scales)(q)) + str(jax.make_jaxpr(jax_fp4.unswizzle_scales)(s))
    assert "jf4_swizzle" in jaxpr and "jf4_unswizzle" in jaxpr


def test_public_swizzle_scales_under_vmap(rng):
    xb = jnp.asarray(random_input(rng, (3, 96, 130), jnp.float32))  # scale matrix [130, 3]: padding
    qb = jax.vmap(lambda x: jax_fp4.quantize(x, MXFP8(), axis=0))(xb)
    sb = jax.vmap(jax_fp4.swizzle_scales)(qb)
    for i in range(3):
        want = jax_fp4.quantize(xb[i], MXFP8(), axis=0, scale_layout="swizzled").scale
        assert_leaf_bits(sb.scale[i], want, f"example {i}")
    assert_leaf_bits(jax.vmap(jax_fp4.unswizzle_scales)(sb).scale, qb.scale, "vmap unswizzle")


# ---- errors ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call,match", [
    (lambda: swizzle(jnp.zeros((4,), jnp.uint8)), r"jf4_swizzle: scales uint8\[4\]: expected .* rank >= 2"),
    (lambda: swizzle(jnp.zeros((4, 4), jnp.float32)), r"float32\[4, 4\]: expected an 8-bit scale dtype"),
    (lambda: swizzle(jnp.zeros((4, 4), jnp.float4_e2m1fn)), "expected an 8-bit scale dtype"),
    (lambda: unswizzle(jnp.zeros((128, 4), jnp.uint8), 129, 4),
     r"jf4_unswizzle: scales uint8\[128, 4\]: .* \[256, 4\] for a \[129, 4\] scale matrix"),
    (lambda: unswizzle(jnp.zeros((128, 6), jnp.uint8), 100, 6), r"\[128, 8\] for a \[100, 6\]"),
    (lambda: unswizzle(jnp.zeros((128, 4), jnp.uint8), -1, 4), "non-negative ints"),
    (lambda: unswizzle_p.bind(jnp.zeros((128, 4), jnp.uint8), rows=1.5, cols=4), "non-negative ints"),
    (lambda: jax.jit(swizzle)(jnp.zeros((2,), jnp.float8_e4m3fn)), "rank >= 2"),
])
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_primitives_are_the_public_path():
    q = jax_fp4.quantize(jnp.ones((4, 32)), NVFP4())
    eqns = jax.make_jaxpr(jax_fp4.swizzle_scales)(q).jaxpr.eqns
    assert any(e.primitive is swizzle_p for e in eqns)
