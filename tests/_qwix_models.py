"""Small Flax models for the qwix provider tests, each in two forms: written as plain Flax (what qwix intercepts) and
built on jax_fp4's layer path (make_dot_general / make_einsum / jax_fp4.ragged_dot with the same key sources), so
that the provider's results can be compared with the layer path's bit for bit. Widths are multiples of 32 (MXFP8
blocks) and of 16 (NVFP4 16x16 weight tiles)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from jax_fp4.flax import make_dot_general
from jax_fp4.flax.einsum import make_einsum
from jax_fp4.flax.moe import dispatch, group_alignment
from jax_fp4.flax.nnx_layers import draw_key
from jax_fp4.grouped_gemm import ragged_dot
from jax_fp4.recipes import resolve


# ---- NNX: a block of an nnx.Einsum projection and an nnx.Linear MLP --------------------------------------------------
class NnxBlock(nnx.Module):
    """x [B, T, d] -> x + down(gelu(up(proj(x)))); proj is an nnx.Einsum ("btd,dhk->bthk"). recipe None: plain Flax;
    else the layer path with the block's own stochastic-rounding stream ``q`` (or `shared`, when given)."""

    def __init__(self, d: int, rngs: nnx.Rngs, recipe=None, shared: nnx.Rngs | None = None):
        self.q = nnx.Rngs(quantize=rngs.quantize())
        src = self.q if shared is None else shared
        lin = {} if recipe is None else {"dot_general": make_dot_general(recipe, key=src)}
        ein = {} if recipe is None else {"einsum_op": make_einsum(recipe, key=src)}
        self.proj = nnx.Einsum("btd,dhk->bthk", (d, 2, d // 2), (2, d // 2), rngs=rngs, **ein)
        self.up = nnx.Linear(d, 2 * d, rngs=rngs, **lin)
        self.down = nnx.Linear(2 * d, d, rngs=rngs, **lin)

    def __call__(self, x):
        h = self.proj(x).reshape(x.shape)
        return x + self.down(jax.nn.gelu(self.up(h)))


class NnxStack(nnx.Module):
    """`num_blocks` NnxBlocks created by nnx.vmap and run by nnx.scan, each block under nnx.remat."""

    def __init__(self, d: int, num_blocks: int, rngs: nnx.Rngs, recipe=None):
        @nnx.split_rngs(splits=num_blocks)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(r):
            return NnxBlock(d, r, recipe)

        self.blocks = make(rngs)
        self.head_q = nnx.Rngs(quantize=rngs.quantize())
        lin = {} if recipe is None else {"dot_general": make_dot_general(recipe, key=self.head_q)}
        self.head = nnx.Linear(d, d, rngs=rngs, **lin)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        @nnx.remat
        def body(block, h):
            return block(h)

        return self.head(body(self.blocks, x))


# ---- NNX: a mixture-of-experts block calling jax.lax.ragged_dot ------------------------------------------------------
class NnxMoE(nnx.Module):
    """x [T, d] -> top-k routed experts (gelu MLP), tokens sorted by expert. recipe None: the expert GEMMs are
    `jax.lax.ragged_dot` on the router's group sizes; else the layer path: jax_fp4.ragged_dot on groups padded to
    the recipe's wgrad block (the layout of jax_fp4.flax.moe.dispatch), keys drawn per call from the stream ``q``."""

    def __init__(self, d: int, hidden: int, experts: int, top_k: int, rngs: nnx.Rngs, recipe=None):
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.router = nnx.Linear(d, experts, use_bias=False, rngs=rngs)
        self.wi = nnx.Param(init(rngs.params(), (experts, d, hidden)))
        self.wo = nnx.Param(init(rngs.params(), (experts, hidden, d)))
        self.q = nnx.Rngs(quantize=rngs.quantize())
        self.recipe = None if recipe is None else resolve(recipe)
        self.experts, self.top_k = experts, top_k

    def _ragged(self, x, w, sizes):
        if self.recipe is None:
            return jax.lax.ragged_dot(x, w, sizes)
        key = draw_key(self.recipe, self.q, "quantize", (x, w), "NnxMoE")
        return ragged_dot(x, w, sizes, recipe=self.recipe, key=key)

    def __call__(self, x):
        t, d = x.shape
        probs = jax.nn.softmax(self.router(x).astype(jnp.float32), axis=-1)
        top_p, top_e = jax.lax.top_k(probs, self.top_k)
        align = 1 if self.recipe is None else group_alignment(self.recipe)
        rows, sizes, capacity = dispatch(top_e.astype(jnp.int32), self.experts, align)
        src = jnp.full((capacity,), t, jnp.int32).at[rows.reshape(-1)].set(
            jnp.repeat(jnp.arange(t, dtype=jnp.int32), self.top_k))
        xs = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])[src]
        h = jax.nn.gelu(self._ragged(xs, self.wi[...], sizes))
        o = self._ragged(h, self.wo[...], sizes)
        return jnp.sum(top_p[..., None] * o[rows].astype(jnp.float32), axis=1).astype(x.dtype)


# ---- Linen: a block of nn.DenseGeneral / nn.Dense layers, run under nn.remat --------------------------------------
class LinenBlock(nn.Module):
    d: int
    dot_general: Any = None  # None: Flax's own (lax.dot_general)

    @nn.compact
    def __call__(self, x):
        kw = {} if self.dot_general is None else {"dot_general": self.dot_general}
        h = nn.DenseGeneral((2, self.d // 2), name="proj", **kw)(x).reshape(x.shape)
        h = nn.Dense(2 * self.d, name="up", **kw)(h)
        return x + nn.Dense(self.d, name="down", **kw)(jax.nn.gelu(h))


class LinenStack(nn.Module):
    d: int
    num_blocks: int
    recipe: Any = None  # None: plain Flax; else the layer path (make_dot_general, keys from "quantize")

    @nn.compact
    def __call__(self, x):
        dg = None if self.recipe is None else make_dot_general(self.recipe)
        block = nn.remat(LinenBlock)
        for i in range(self.num_blocks):
            x = block(self.d, dg, name=f"blocks_{i}")(x)
        return x
