"""vmap over quantized layers (ensembles, per-example gradients): batched stochastic-rounding quantizes run one
quantize per example in a loop (compiled once), with the per-example bits, and an nnx.vmap ensemble trains on the
CPU."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_fp4
from jax_fp4 import recipes
from jax_fp4.flax import nnx as fnnx

SR = jax_fp4.NVFP4(stochastic_rounding=True)
SR_FWD = recipes.Recipe("sr-fwd", SR, jax_fp4.NVFP4(), SR, jax_fp4.NVFP4(), jax_fp4.NVFP4(), jax_fp4.NVFP4())


def test_vmap_grad_of_an_sr_forward_compiles_fast_and_keeps_the_bits():
    xs = jax.random.normal(jax.random.key(1), (4, 32, 64))
    w = jax.random.normal(jax.random.key(2), (64, 64))
    keys = jax.random.split(jax.random.key(0), 4)
    for recipe in (SR_FWD, recipes.NVFP4()):
        grad = jax.grad(lambda x, k, r=recipe: jax_fp4.dense(x, w, recipe=r, key=k).sum())
        t0 = time.perf_counter()
        compiled = jax.jit(jax.vmap(grad)).lower(xs, keys).compile()
        seconds = time.perf_counter() - t0
        assert seconds < 60, f"{recipe.name}: vmap(grad(dense)) took {seconds:.0f} s to compile"
        out = compiled(xs, keys)
        one = jax.jit(grad)  # (compiled too: the reference path's eager and jitted gradients may round differently)
        for i in range(4):  # each example's own key and stream, as the unbatched call
            np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(one(xs[i], keys[i])))


class _MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = fnnx.Dense(64, 128, recipe="nvfp4", dtype=jnp.bfloat16, rngs=rngs)
        self.down = fnnx.Dense(128, 64, recipe="nvfp4", dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def test_nnx_vmap_ensemble_with_nvfp4_gradients():
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return _MLP(rngs)

    ens = make(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 32, 64), jnp.bfloat16)

    @nnx.jit
    def step(ens, x):
        def loss(ens):
            y = nnx.vmap(lambda m, x: m(x), in_axes=(0, 0), out_axes=0)(ens, x)
            return jnp.mean(y.astype(jnp.float32) ** 2)
        return nnx.value_and_grad(loss)(ens)

    loss, grads = step(ens, x)
    g = np.asarray(grads["up"]["kernel"][...])
    assert g.shape == (3, 64, 128) and np.isfinite(g).all() and np.isfinite(float(loss))
    assert not np.array_equal(g[0], g[1])  # members differ
