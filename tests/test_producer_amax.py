"""x's tensor amax from its producer (`jax_fp4.dense(..., x_amax=)`, `quantize_rowwise_columnwise(..., amax=)`, the
Flax Dense layers' ``x_amax``): the same bits as the quantizer's own amax and NaN passes, which it removes."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _quantize_util import assert_leaf_bits, random_input

import jax_fp4
from jax_fp4 import NVFP4, recipes
from jax_fp4._src import ffi

RECIPES = ["nvfp4-fwd-mxfp8-bwd", "nvfp4", "nvfp4-fwd-mxfp8-bwd-4over6", "mxfp8"]


def _same(got, want, what):
    """Every leaf of two pytrees has the same bits."""
    g, w = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(g) == len(w), what
    for i, (a, b) in enumerate(zip(g, w, strict=True)):
        assert_leaf_bits(a, b, f"{what} (leaf {i})")


def _step(recipe, with_amax):
    def loss(x, w, b, g):
        a = jnp.max(jnp.abs(x)) if with_amax else None
        y = jax_fp4.dense(x, w, b, recipe=recipe, key=jax.random.key(1), x_amax=a)
        return jnp.sum(y.astype(jnp.float32) * g), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _operands(seed, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(random_input(rng, (64, 96), dtype, edges=False))
    w = jnp.asarray(rng.standard_normal((96, 64)).astype(np.float32) * 0.1, dtype)
    b = jnp.asarray(rng.standard_normal(64), jnp.float32)
    g = jnp.asarray(rng.standard_normal((64, 64)), jnp.bfloat16)
    return x, w, b, g


@pytest.mark.parametrize("recipe", RECIPES)
def test_dense_with_producer_amax_keeps_the_bits(recipe):
    x, w, b, g = _operands(3)
    for scale in (1.0, 2.0**-100, 2.0**100):  # the amax sets the tensor scale: far from 1 in both directions
        xs = (x.astype(jnp.float32) * scale).astype(x.dtype)
        want = _step(recipe, False)(xs, w, b, g)
        got = _step(recipe, True)(xs, w, b, g)
        _same(got, want, f"{recipe} x * {scale}")


@pytest.mark.parametrize("recipe", ["nvfp4-fwd-mxfp8-bwd", "nvfp4"])
def test_nan_in_x_gives_the_same_outputs(recipe):
    x, w, b, g = _operands(4)
    x = x.at[5, 7].set(jnp.nan)
    (_, y0), grads0 = _step(recipe, False)(x, w, b, g)
    (_, y1), grads1 = _step(recipe, True)(x, w, b, g)
    assert bool(jnp.all(jnp.isnan(y0))) and bool(jnp.all(jnp.isnan(y1)))
    _same(grads1, grads0, f"{recipe} gradients with a NaN in x")


@pytest.mark.skipif(not ffi.HAS_CPU_KERNELS, reason="the amax pass is a jf4_amax custom call with the CPU extension")
def test_producer_amax_removes_the_amax_pass_over_x():
    x, w, b, g = _operands(5)

    def amax_calls(with_amax):
        text = _step("nvfp4-fwd-mxfp8-bwd", with_amax).lower(x, w, b, g).compile().as_text()
        return len(re.findall(r'custom_call_target="jf4_amax"', text))

    # without: x's and w's fprop operands each run one; with: w's alone
    assert (amax_calls(False), amax_calls(True)) == (2, 1)


def test_quantize_rowwise_columnwise_amax_equals_its_own():
    x = jnp.asarray(random_input(np.random.default_rng(6), (64, 128), jnp.bfloat16))
    for row, col in ((NVFP4(), NVFP4()), (NVFP4(scaling_2d=True), NVFP4(rht=True)), (NVFP4(use_4over6=True), None)):
        want = jax_fp4.quantize_rowwise_columnwise(x, row, col, key=jax.random.key(2))
        got = jax_fp4.quantize_rowwise_columnwise(x, row, col, key=jax.random.key(2), amax=jnp.max(jnp.abs(x)))
        _same(got, want, f"{row!r} + {col!r}")


def test_bad_amax_is_refused():
    x, w, _, _ = _operands(7)
    with pytest.raises(ValueError, match=r"x_amax must be a float scalar .*got float32\[2\]"):
        jax_fp4.dense(x, w, recipe="nvfp4", x_amax=jnp.ones((2,), jnp.float32))
    with pytest.raises(ValueError, match=r"amax must be a float scalar .*got int32\[\]"):
        jax_fp4.quantize_rowwise_columnwise(x, NVFP4(), None, amax=jnp.int32(3))


@pytest.mark.parametrize("recipe", ["nvfp4-fwd-mxfp8-bwd", "nvfp4-fwd-mxfp8-bwd-4over6"])
def test_flax_dense_layers_take_the_producer_amax(recipe):
    """LayerNormMLP / LayerNormDense (each Dense running its own amax pass) == their submodules composed by hand with
    the norm's and the activation's amax handed over (``x_amax``): values and gradients, NNX and Linen."""
    nnx = pytest.importorskip("flax.nnx")
    import flax.linen as nn

    from jax_fp4.flax import linen as fl
    from jax_fp4.flax import nnx as fx

    def amax(y):
        return jnp.max(jnp.abs(y))

    def mlp_by_hand(m, x):
        y = m.norm(x)
        h = jax.nn.gelu(m.up(y, x_amax=amax(y)))
        return m.down(h, x_amax=amax(h))

    def lnd_by_hand(m, x):
        y = m.norm(x)
        return m.dense(y, x_amax=amax(y))

    x = jnp.asarray(random_input(np.random.default_rng(8), (2, 32, 64), jnp.bfloat16, edges=False))
    r = recipes.by_name(recipe)
    cases = {"LayerNormMLP": (fx.LayerNormMLP(64, 128, recipe=r, rngs=nnx.Rngs(0)), mlp_by_hand),
             "LayerNormDense": (fx.LayerNormDense(64, 32, recipe=r, rngs=nnx.Rngs(1)), lnd_by_hand)}
    for name, (layer, by_hand) in cases.items():
        def grads(f, layer=layer):
            g = nnx.grad(lambda m, x: jnp.sum(f(m, x).astype(jnp.float32) ** 2), argnums=(0, 1))
            return jax.tree.leaves(nnx.jit(g)(layer, x))

        _same(nnx.jit(by_hand)(layer, x), nnx.jit(lambda m, x: m(x))(layer, x), f"nnx {name} {recipe}")
        _same(grads(by_hand), grads(lambda m, x: m(x)), f"nnx {name} {recipe} gradients")

    layer = fl.LayerNormMLP(128, r)
    p = layer.init(jax.random.key(0), x)["params"]
    norm_name = next(k for k in p if k not in ("up", "down"))

    def linen_apply(p, x):
        return layer.apply({"params": p}, x)

    def linen_by_hand(p, x):
        y = nn.LayerNorm(epsilon=1e-6).apply({"params": p[norm_name]}, x)
        h = jax.nn.gelu(fl.Dense(128, r).apply({"params": p["up"]}, y, amax(y)))
        return fl.Dense(64, r).apply({"params": p["down"]}, h, amax(h))

    _same(jax.jit(linen_by_hand)(p, x), jax.jit(linen_apply)(p, x), f"linen LayerNormMLP {recipe}")
    gw = jax.jit(jax.grad(lambda p, x: jnp.sum(linen_apply(p, x).astype(jnp.float32) ** 2)))(p, x)
    gc = jax.jit(jax.grad(lambda p, x: jnp.sum(linen_by_hand(p, x).astype(jnp.float32) ** 2)))(p, x)
    _same(jax.tree.leaves(gc), jax.tree.leaves(gw), f"linen LayerNormMLP {recipe} gradients")
