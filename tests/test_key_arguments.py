"""Every key / rngs argument is validated whether or not the recipe (or format) uses it: a value that is neither
None nor a JAX PRNG key (nor, for the NNX layers, an nnx.Rngs / nnx.RngStream) raises TypeError naming the entry
point, for recipes that round stochastically (nvfp4), that do not (mxfp8) and for BF16 (README, "Drop-in
guarantees")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jax_fp4
from jax_fp4 import recipes
from jax_fp4.flax import make_dot_general
from jax_fp4.flax import nnx as fnnx
from jax_fp4.flax.einsum import make_einsum
from jax_fp4.flax.moe import MoEMLP

D = 32
X = jnp.ones((D, D), jnp.float32)
BAD = {"str": "garbage", "int": 3, "float array": jnp.ones((2,)), "int32 key-shaped": jnp.zeros((2,), jnp.int32)}


def _calls(recipe, bad):
    dn = (((1,), (0,)), ((), ()))
    return {
        "dense": lambda: jax_fp4.dense(X, X, recipe=recipe, key=bad),
        "dot_general": lambda: jax_fp4.dot_general(X, X, dn, recipe=recipe, key=bad),
        "ragged_dot": lambda: jax_fp4.ragged_dot(X, jnp.ones((2, D, D)), jnp.array([16, 16]), recipe=recipe, key=bad),
        "make_dot_general(key=)": lambda: make_dot_general(recipe, key=bad),
        "make_dot_general call key=": lambda: make_dot_general(recipe)(X, X, dn, key=bad),
        "make_dot_general(stream) call key=": lambda: make_dot_general(recipe, key=nnx.Rngs(0))(X, X, dn, key=bad),
        "make_einsum(key=)": lambda: make_einsum(recipe, key=bad),
        "make_einsum call key=": lambda: make_einsum(recipe)("mk,kn->mn", X, X, key=bad),
        "make_einsum(stream) call key=": lambda: make_einsum(recipe, key=nnx.Rngs(0))("mk,kn->mn", X, X, key=bad),
        "nnx.Dense rngs=": lambda: fnnx.Dense(D, D, recipe=recipe, rngs=nnx.Rngs(0))(X, rngs=bad),
        "nnx.LayerNormDense rngs=": lambda: fnnx.LayerNormDense(D, D, recipe=recipe, rngs=nnx.Rngs(0))(X, rngs=bad),
        "nnx.LayerNormMLP rngs=": lambda: fnnx.LayerNormMLP(D, D, recipe=recipe, rngs=nnx.Rngs(0))(X, rngs=bad),
        "MoEMLP rngs=": lambda: MoEMLP(D, D, 2, recipe=recipe, rngs=nnx.Rngs(0))(X, rngs=bad),
    }


@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp8", "bf16"])
def test_a_bad_key_raises_whatever_the_recipe(recipe, bad):
    for name, call in _calls(recipes.by_name(recipe), BAD[bad]).items():
        try:
            call()
        except TypeError as e:
            assert "PRNG key" in str(e), (name, str(e))
        else:
            raise AssertionError(f"{name} accepted key {BAD[bad]!r}")


def test_quantize_ops_check_their_key_for_every_format():
    for fmt in (jax_fp4.MXFP8(), jax_fp4.NVFP4()):
        for call in (lambda f=fmt: jax_fp4.quantize(X, f, key="k"),
                     lambda f=fmt: jax_fp4.fake_quantize(X, f, -1, key="k"),
                     lambda f=fmt: jax_fp4.grouped_quantize(X, jnp.array([16, 16]), f, key="k")):
            with pytest.raises(TypeError, match="PRNG key"):
                call()


def test_good_keys_pass():
    k = jax.random.key(0)
    for call in _calls(recipes.MXFP8(), k).values():
        call()
    fnnx.Dense(D, D, recipe=recipes.MXFP8(), rngs=nnx.Rngs(0))(X, rngs=nnx.Rngs(1))
