"""Inconsistent inputs are rejected with errors that name them (CPU, small shapes, mostly trace time):

* QuantizedArray fields against the format, at construction and at use (dtypes, scale shape vs data shape / axis /
  layout, the NVFP4 tensor amax, the 1x64 window amax); vmap's leading axes are accepted;
* dimension numbers outside an operand's rank (no modulo wrapping);
* recipes: strings are names (`recipes.by_name`, which round-trips every recipe this package makes), anything else a
  TypeError; a Recipe rejects non-Format operands;
* a non-int block axis.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from jax_fp4 import MXFP8, NVFP4, QuantizedArray, recipes

X = jax.random.normal(jax.random.key(0), (32, 64), jnp.float32)


def _replace(q, **kw):
    fields = dict(data=q.data, scale=q.scale, amax=q.amax, window_amax=q.window_amax, fmt=q.fmt, axis=q.axis,
                  scale_layout=q.scale_layout)
    return QuantizedArray(**(fields | kw))


@pytest.mark.parametrize("fmt", [NVFP4(), NVFP4(scaling_2d=True), MXFP8()], ids=repr)
@pytest.mark.parametrize("axis", [-1, 0])
def test_scale_shape_must_match_data(fmt, axis):
    q = jax_fp4.quantize(X, fmt, axis=axis)
    with pytest.raises(ValueError, match="compact scale must be"):
        _replace(q, scale=q.scale.T)
    with pytest.raises(ValueError, match="compact scale must be"):
        _replace(q, scale=q.scale.reshape(-1))
    with pytest.raises(ValueError, match="scale must be float8"):
        _replace(q, scale=q.scale.astype(jnp.float32))
    with pytest.raises(ValueError, match="data must be"):
        _replace(q, data=q.data.astype(jnp.float32))
    if isinstance(fmt, MXFP8):  # the scales of one orientation with the axis of the other (NVFP4 stores the block
        with pytest.raises(ValueError, match="compact scale must be"):  # axis last: either reading is consistent)
            _replace(q, axis=-2 if axis == -1 else -1)
    sw = jax_fp4.swizzle_scales(q)
    with pytest.raises(ValueError, match="swizzled scale must be"):
        _replace(sw, scale=sw.scale[:64])
    with pytest.raises(ValueError, match="swizzled scale must be"):
        _replace(sw, scale=sw.scale.reshape(-1))
    # the checks also run at use (a QuantizedArray built without them, e.g. by tree_unflatten of other leaves)
    bad = object.__new__(QuantizedArray)
    for k, v in dict(data=q.data, scale=q.scale.T, amax=q.amax, window_amax=None, fmt=fmt, axis=q.axis,
                     scale_layout="compact").items():
        object.__setattr__(bad, k, v)
    with pytest.raises(ValueError, match="compact scale must be"):
        jax_fp4.dequantize(bad)


def test_amax_fields():
    q = jax_fp4.quantize(X, NVFP4())
    with pytest.raises(ValueError, match="NVFP4 needs amax"):
        _replace(q, amax=None)
    with pytest.raises(ValueError, match="amax must be a float32 scalar"):
        _replace(q, amax=jnp.ones((3,), jnp.float32))
    with pytest.raises(ValueError, match="amax must be a float32 scalar"):
        _replace(q, amax=q.amax.astype(jnp.bfloat16))
    m = jax_fp4.quantize(X, MXFP8())
    with pytest.raises(ValueError, match="no tensor amax"):
        _replace(m, amax=jnp.float32(1.0))
    w = jax_fp4.quantize(jax.random.normal(jax.random.key(1), (64, 64)), NVFP4(local_1x64=True))
    assert w.amax is None and w.window_amax is not None
    with pytest.raises(ValueError, match="window_amax must be float32"):
        _replace(w, window_amax=None)
    with pytest.raises(ValueError, match="window_amax must be float32"):
        _replace(w, window_amax=w.window_amax.T)
    with pytest.raises(ValueError, match="local_1x64=True"):
        _replace(q, window_amax=jnp.zeros((32, 1), jnp.float32))


def test_transformations_still_build_quantized_arrays():
    xs = jnp.stack([X, 2 * X])
    for fmt, layout in ((NVFP4(), "compact"), (NVFP4(), "swizzled"), (MXFP8(), "swizzled")):
        qs = jax.vmap(lambda x, f=fmt, lo=layout: jax_fp4.quantize(x, f, scale_layout=lo))(xs)
        assert qs.data.shape[0] == 2
        y = jax.vmap(jax_fp4.dequantize)(qs)
        np.testing.assert_array_equal(np.asarray(y[1]), np.asarray(jax_fp4.dequantize(
            jax_fp4.quantize(2 * X, fmt, scale_layout=layout))))
        jax.eval_shape(lambda x, f=fmt: jax_fp4.quantize(x, f), X)
        _, ys = jax.lax.scan(lambda c, x, f=fmt: (c, jax_fp4.quantize(x, f)), 0, xs)
        assert ys.scale.shape[0] == 2


def test_dimension_numbers_past_the_rank():
    a, b = jax_fp4.quantize(X, MXFP8()), jax_fp4.quantize(X.T, MXFP8(), axis=0)
    assert jax_fp4.scaled_dot_general(a, b, (((1,), (0,)), ((), ()))).shape == (32, 32)
    for dn in ((((3,), (0,)), ((), ())), (((1,), (2,)), ((), ())), (((-3,), (0,)), ((), ()))):
        with pytest.raises(ValueError, match="out of range"):
            jax_fp4.scaled_dot_general(a, b, dn)
        with pytest.raises(ValueError, match="out of range"):
            jax_fp4.dot_general(X, X.T, dn, recipe=recipes.MXFP8())


def test_recipes_by_name():
    variants = [recipes.BF16()]
    for g in ("e4m3", "e5m2"):
        variants += [recipes.MXFP8(g), recipes.NVFP4Fwd_MXFP8Bwd(g), recipes.NVFP4_1x64(g)]
    variants += [recipes.NVFP4(*o) for o in itertools.product((True, False), repeat=3)]
    variants += [recipes.NVFP4(rht=False), recipes.NVFP4(stochastic_rounding=False, weight_2d=False)]
    assert len({r.name for r in variants}) == 15
    for r in variants:
        assert recipes.by_name(r.name) == r, r.name
    for name, factory in recipes.RECIPES.items():
        assert recipes.by_name(name) == factory()
    with pytest.raises(ValueError, match="unknown recipe 'fp8'"):
        recipes.by_name("fp8")
    with pytest.raises(TypeError, match="str"):
        recipes.by_name(recipes.MXFP8())


def test_recipe_arguments():
    x, w = X.astype(jnp.bfloat16), X.T[:, :32].astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(jax_fp4.dense(x, w, recipe="mxfp8"), np.float32),
                                  np.asarray(jax_fp4.dense(x, w, recipe=recipes.MXFP8()), np.float32))
    for bad in (5, None, MXFP8()):
        with pytest.raises(TypeError, match="recipe must be"):
            jax_fp4.dense(x, w, recipe=bad)
    with pytest.raises(ValueError, match="unknown recipe"):
        jax_fp4.dense(x, w, recipe="fp4")
    with pytest.raises(TypeError, match="fprop_x must be a jax_fp4 Format"):
        recipes.Recipe("s", "nvfp4", NVFP4())
    with pytest.raises(TypeError, match="wgrad_dy must be a jax_fp4 Format"):
        dataclasses.replace(recipes.MXFP8(), wgrad_dy="e5m2")


@pytest.mark.parametrize("axis", [None, 1.0, "0", True])
def test_block_axis_must_be_an_int(axis):
    for fmt in (NVFP4(), MXFP8()):
        with pytest.raises(TypeError, match="block axis must be an int"):
            jax_fp4.quantize(X, fmt, axis=axis)
        with pytest.raises(ValueError, match="block axis must be an int"):  # also a ValueError
            jax_fp4.fake_quantize(X, fmt, axis=axis)
    assert jax_fp4.quantize(X, MXFP8(), axis=np.int64(0)).axis == -2


def test_quantized_array_more_inconsistent_fields():
    """Fields inconsistent in other ways than the issue's: a wrongly typed amax, a format whose data dtype differs,
    a reshaped (3-D) or mismatched scale, a 1x64 window amax on a 1D tensor, a format given as a string."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((32, 64)), jnp.float32)
    q = jax_fp4.quantize(x, jax_fp4.NVFP4())
    QA = jax_fp4.QuantizedArray
    bad = {
        "amax": lambda: QA(q.data, q.scale, jnp.int32(3), None, fmt=q.fmt, axis=-1),
        "amax ": lambda: QA(q.data, q.scale, jnp.float16(3), None, fmt=q.fmt, axis=-1),
        "data must be float8_e4m3fn": lambda: QA(q.data, q.scale, q.amax, None, fmt=jax_fp4.MXFP8(), axis=-1),
        "compact scale": lambda: QA(q.data, q.scale.reshape(2, 16, 4), q.amax, None, fmt=q.fmt, axis=-1),
        "compact scale ": lambda: QA(q.data[:, :48], q.scale, q.amax, None, fmt=q.fmt, axis=-1),
        "window_amax": lambda: QA(q.data, q.scale, q.amax, jnp.ones((32, 1)), fmt=q.fmt, axis=-1),
    }
    for what, make in bad.items():
        with pytest.raises(ValueError, match=what.strip()):
            make()
    with pytest.raises(TypeError, match="fmt must be a jax_fp4 Format"):
        QA(q.data, q.scale, q.amax, None, fmt="nvfp4", axis=-1)


def test_scaled_dot_general_sizes_must_pair():
    a = jax_fp4.quantize(jnp.ones((64, 64), jnp.float32), MXFP8())
    b = jax_fp4.quantize(jnp.ones((32, 64), jnp.float32), MXFP8(), axis=0)
    with pytest.raises(ValueError, match=r"lhs dimension 1 \(64\) != rhs dimension 0 \(32\)"):
        jax_fp4.scaled_dot_general(a, b, (((1,), (0,)), ((), ())))


def test_recipe_names_ignore_case_and_separators():
    assert recipes.by_name("MXFP8") == recipes.MXFP8()
    assert recipes.by_name(" NVFP4_1x64 ") == recipes.NVFP4_1x64()
    assert recipes.by_name("nvfp4_fwd_mxfp8_bwd") == recipes.NVFP4Fwd_MXFP8Bwd()
    x = jnp.ones((32, 64), jnp.bfloat16)
    assert jax_fp4.dense(x, jnp.ones((64, 32), jnp.bfloat16), recipe="MXFP8").shape == (32, 32)
    with pytest.raises(ValueError, match="unknown recipe 'MX FP8'"):
        recipes.by_name("MX FP8")
