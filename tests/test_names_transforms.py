"""Recipe names everywhere, keys refused when they are not keys, fake_quantize under every transformation, and one
forward-mode error for every quantized recipe."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from jax_fp4 import blocking, diagnostics, policy, recipes
from jax_fp4.flax import make_dot_general
from jax_fp4.schedule import PrecisionSwitch

X = jax.random.normal(jax.random.key(0), (32, 64), jnp.float32) * 4


def test_recipe_names_accepted_everywhere():
    assert PrecisionSwitch(0.9, "bf16").to == recipes.BF16()
    assert PrecisionSwitch(3, "MXFP8", "all").recipe("nvfp4") == recipes.MXFP8()
    assert policy.Policy((("head", "mxfp8"),), "nvfp4") == policy.Policy((("head", recipes.MXFP8()),),
                                                                         recipes.NVFP4())
    assert policy.uniform("nvfp4-1x64").default == recipes.NVFP4_1x64()
    assert policy.exclude("*/out", "mxfp8-hybrid").rules[0].recipe == recipes.MXFP8("e5m2")
    assert policy.last_blocks(1, "mxfp8", num_blocks=3).resolve("blocks/2/mlp") == recipes.MXFP8()
    assert hash(policy.uniform("mxfp8")) == hash(policy.uniform(recipes.MXFP8()))
    assert blocking.needs("mxfp8", differentiated=True) == blocking.needs(recipes.MXFP8(), differentiated=True)
    assert diagnostics.dense_stats(X, X.T, recipe="mxfp8").shape == (6, 6)
    for bad, err in (("nvfp5", ValueError), (3, TypeError)):
        with pytest.raises(err):
            PrecisionSwitch(0.5, bad)
        with pytest.raises(err):
            policy.Policy((("a", bad),))


@pytest.mark.parametrize("key", ["abc", 5, jnp.ones(3), jnp.ones((2,), jnp.int32)], ids=str)
def test_a_key_that_is_not_a_key_is_refused(key):
    """Even where nothing rounds stochastically (it would otherwise be silently ignored)."""
    with pytest.raises(TypeError, match="PRNG key"):
        jax_fp4.quantize(X, jax_fp4.MXFP8(), key=key)
    with pytest.raises(TypeError, match="PRNG key"):
        jax_fp4.quantize_rowwise_columnwise(X, jax_fp4.NVFP4(), jax_fp4.MXFP8(), key=key)
    with pytest.raises(TypeError, match="PRNG key"):
        jax_fp4.grouped_quantize(X, jnp.array([16, 16], jnp.int32), jax_fp4.MXFP8(), key=key)
    with pytest.raises(TypeError, match="PRNG key"):
        jax_fp4.fake_quantize(X, jax_fp4.NVFP4(), key=key)
    dn = (((1,), (0,)), ((), ()))
    for recipe in ("mxfp8", "bf16"):  # BF16 quantizes nothing, and still refuses a non-key
        with pytest.raises(TypeError, match="PRNG key"):
            jax_fp4.dense(X, X.T, recipe=recipe, key=key)
        with pytest.raises(TypeError, match="PRNG key"):
            jax_fp4.dot_general(X, X.T, dn, recipe=recipe, key=key)
        with pytest.raises(TypeError, match="PRNG key"):
            make_dot_general(recipe)(X, X.T, dn, key=key)
        with pytest.raises(TypeError, match="PRNG key"):
            jax_fp4.ragged_dot(X, jnp.stack([X.T, X.T]), jnp.array([16, 16], jnp.int32), recipe=recipe, key=key)
    if not isinstance(key, str):
        with pytest.raises(TypeError, match="PRNG key"):
            make_dot_general("mxfp8", key=key)
    jax_fp4.quantize(X, jax_fp4.MXFP8(), key=jax.random.PRNGKey(0))  # raw and typed keys pass
    jax_fp4.quantize(X, jax_fp4.MXFP8(), key=jax.random.key(0))


@pytest.mark.parametrize("fmt,clip", [(jax_fp4.NVFP4(), False), (jax_fp4.MXFP8(), True),
                                      (jax_fp4.NVFP4(stochastic_rounding=True), True)], ids=str)
def test_fake_quantize_under_every_transformation(fmt, clip):
    key = jax.random.key(2) if fmt.stochastic_rounding else None
    f = lambda x: jax_fp4.fake_quantize(x, fmt, key=key, clip_gradient=clip)  # noqa: E731
    y = f(X)
    g = jax.grad(lambda x: f(x).sum())(X)
    y_jvp, t = jax.jvp(f, (X,), (jnp.ones_like(X),))
    y_lin, lin = jax.linearize(f, X)
    for a in (y_jvp, y_lin):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(y))
    for a in (t, lin(jnp.ones_like(X))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(g))
    if clip and isinstance(fmt, jax_fp4.NVFP4):  # (MXFP8's power-of-two scales leave these values unclipped)
        assert 0 < float(jnp.mean(g == 0)) < 1  # clipped elements get no gradient, the others pass
    x1 = X[:1, :32]
    np.testing.assert_array_equal(np.asarray(jax.jacfwd(f)(x1)), np.asarray(jax.jacrev(f)(x1)))
    assert not np.asarray(jax.hessian(lambda x: f(x).sum())(x1)).any()  # the STE is linear


@pytest.mark.parametrize("name", [n for n in recipes.RECIPES if n != "bf16"])
@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "hessian"])
def test_one_forward_mode_error_for_every_recipe(name, transform):
    """Also where the backward operands could not be blocked (M = 1): the forward-mode error comes first."""
    w = jnp.ones((64, 64))
    f = lambda x: jax_fp4.dense(x, w, recipe=name, key=jax.random.key(0)).sum()  # noqa: E731
    x = X[:1]
    call = {"jvp": lambda: jax.jvp(f, (x,), (x,)), "jacfwd": lambda: jax.jacfwd(f)(x),
            "hessian": lambda: jax.hessian(f)(x)}[transform]
    with pytest.raises(TypeError, match="reverse-mode differentiation only"):
        call()
    jax.hessian(lambda x: jax_fp4.dense(x, w, recipe="bf16").sum())(x)  # BF16: plain lax, every transform
