"""Forward-mode differentiation (jax.jvp, jax.jacfwd) through every quantized entry point ends in one TypeError,
"<entry point> supports reverse-mode differentiation only", whatever the recipe and whether or not keys were given:
the check runs before any key lookup (an NNX layer's rng stream, Linen's "quantize" collection, `key=`) and before
the shape checks of the backward operands. jax.linearize traces as jax.grad does (the same LinearizeTracers), so its
trace passes, and applying its linear function raises jax's own custom_vjp error (tested as documented)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jax_fp4
from jax_fp4 import recipes
from jax_fp4.flax import linen as flinen
from jax_fp4.flax import make_dot_general
from jax_fp4.flax import nnx as fnnx
from jax_fp4.flax.einsum import make_einsum
from jax_fp4.flax.moe import MoEMLP

D = 32
X = jnp.ones((D, D), jnp.float32)
W = jnp.ones((D, D), jnp.float32)
MSG = "supports reverse-mode differentiation only"


def _entry_points(recipe, keyed: bool):
    """{name: f(x)} calling each entry point on x [32, 32], with a key (or rngs) or without."""
    key = jax.random.key(1) if keyed else None
    dense_layer = fnnx.Dense(D, D, recipe=recipe, rngs=nnx.Rngs(0))
    mlp = fnnx.LayerNormMLP(D, D, recipe=recipe, rngs=nnx.Rngs(0))
    moe = MoEMLP(D, D, 2, recipe=recipe, rngs=nnx.Rngs(0))
    lin = nnx.Linear(D, D, dot_general=make_dot_general(recipe), rngs=nnx.Rngs(0))
    stream_lin = nnx.Linear(D, D, dot_general=make_dot_general(recipe, key=nnx.Rngs(quantize=2)), rngs=nnx.Rngs(0))
    ein = nnx.Einsum("mk,kn->mn", (D, D), einsum_op=make_einsum(recipe), rngs=nnx.Rngs(0))
    ldense = flinen.Dense(D, recipe=recipe)
    lvars = ldense.init(jax.random.key(0), X)
    ldrop = nn.Dense(D, dot_general=make_dot_general(recipe))
    dvars = ldrop.init(jax.random.key(0), X)
    lrngs = {"quantize": key} if keyed else {}
    return {
        "dense": lambda x: jax_fp4.dense(x, W, recipe=recipe, key=key),
        "dot_general": lambda x: jax_fp4.dot_general(x, W, (((1,), (0,)), ((), ())), recipe=recipe, key=key),
        "ragged_dot": lambda x: jax_fp4.ragged_dot(x, jnp.ones((2, D, D)), jnp.array([16, 16]), recipe=recipe,
                                                   key=key),
        "nnx.Dense": lambda x: dense_layer(x, rngs=key),
        "nnx.LayerNormMLP": lambda x: mlp(x, rngs=key),
        "MoEMLP": lambda x: moe(x, rngs=key),
        "make_dot_general": lambda x: lin(x),
        "make_dot_general(key=stream)": lambda x: stream_lin(x),
        "make_einsum": lambda x: ein(x),
        "make_einsum(key=)": lambda x: make_einsum(recipe)("mk,kn->mn", x, W, key=key),
        "linen.Dense": lambda x: ldense.apply(lvars, x, rngs=lrngs),
        "linen drop-in": lambda x: ldrop.apply(dvars, x, rngs=lrngs),
    }


@pytest.mark.parametrize("keyed", [False, True], ids=["no key", "key"])
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])  # nvfp4 rounds dy stochastically: it needs keys to train
def test_jvp_gives_one_error_from_every_entry_point(recipe, keyed):
    for f in _entry_points(recipes.by_name(recipe), keyed).values():
        with pytest.raises(TypeError, match=MSG):
            jax.jvp(f, (X,), (X,))


def test_jacfwd_and_shapes_the_backward_cannot_block():
    """M = 1 cannot be blocked by MXFP8's wgrad operands: the forward-mode error still comes first."""
    x1 = jnp.ones((1, D))
    for name, f in _entry_points(recipes.MXFP8(), keyed=False).items():
        if name == "ragged_dot" or name == "MoEMLP":
            continue  # [T, K] with T = 1: shown above with T = 32
        with pytest.raises(TypeError, match=MSG):
            jax.jacfwd(f)(x1)


def test_bf16_keeps_forward_mode():
    f = _entry_points(recipes.BF16(), keyed=False)["nnx.Dense"]
    _, t = jax.jvp(f, (X,), (X,))
    assert t.shape == (D, D)


def test_linearize_traces_and_its_linear_function_raises_jax_error():
    y, f_lin = jax.linearize(lambda x: jax_fp4.dense(x, W, recipe=recipes.MXFP8()), X)
    assert y.shape == (D, D)
    with pytest.raises(TypeError, match="forward-mode autodiff"):
        f_lin(X)
