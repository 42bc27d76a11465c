"""A GPT-style decoder whose attention and MLP GEMMs follow a jax_fp4 training recipe (used by train_lm.py).

Model: token embedding -> n_layers x [x + out(attn(qkv(LN(x)))), x + MLP(LN(x))] -> LN -> logits head.
  * qkv: `jax_fp4.flax.nnx.LayerNormDense` (pre-norm + the fused [d, 3d] projection), out: `jax_fp4.flax.nnx.Dense`
    [d, d], MLP: `jax_fp4.flax.nnx.LayerNormMLP` (pre-norm, [d, 4d] GELU [4d, d]); these GEMMs are quantized as the
    recipe says (fprop, dgrad and wgrad).
  * Unquantized, bfloat16 compute: the token embedding, the attention itself (q.k^T and p.v, causal, rotary position
    embedding on q and k), the final LayerNorm and the logits head (`nnx.Linear`).
Parameters are float32 (AdamW's master weights); every layer computes in bfloat16; the loss is float32. The blocks
are unrolled, or with ``scan_layers`` stacked ([n_layers, ...] parameters) and applied with `nnx.scan`: one compiled
block whatever the depth (XLA compile time of 4 blocks ~2.5x lower; unrolled runs faster on the CPU).

Randomness: `nnx.Rngs(params=seed, quantize=seed + 1)`. The parameters come from the ``params`` stream only, so every
recipe starts from the same weights for the same seed; recipes with stochastic rounding (NVFP4's gradient dy) keep a
``quantize`` stream per layer (seeded from ``rngs["quantize"]``) that draws a fresh key on every call.

Block constraints of the quantized GEMMs: d_model and the MLP width multiples of 64 and the tokens per batch
(batch x seq) a multiple of 128 (MXFP8 blocks of 32 along every GEMM axis, NVFP4 16x16 weight blocks, the RHT's 16).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jax_fp4.flax import nnx as fnnx
from jax_fp4.recipes import BF16, Recipe

VOCAB = 256  # byte-level tokens


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 2
    mlp_ratio: int = 4
    seq: int = 64
    vocab: int = VOCAB
    rope_base: float = 10000.0
    scan_layers: bool = False  # stacked blocks applied with nnx.scan (one compiled block, whatever the depth)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self):
        """A list of problems (empty when the configuration suits the quantized kernels)."""
        errs = []
        if self.d_model % 64:
            errs.append(f"d_model {self.d_model} must be a multiple of 64 (the quantized GEMMs' blocks and tiles)")
        if self.n_heads < 1 or self.d_model % self.n_heads or self.head_dim % 2:
            errs.append(f"n_heads {self.n_heads} must divide d_model {self.d_model} into even head sizes")
        if self.n_layers < 1:
            errs.append(f"n_layers {self.n_layers} must be >= 1")
        return errs


def rope(x, base):
    """Rotary position embedding of x [B, T, H, Dh] (pairs (i, i + Dh/2) rotated by position / base^(2i/Dh))."""
    _, t, _, dh = x.shape
    inv = base ** (-jnp.arange(0, dh // 2, dtype=jnp.float32) * 2.0 / dh)
    ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]  # [T, Dh/2]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Block(nnx.Module):
    """Pre-norm transformer block: x + out(attention(qkv(LN(x)))), then x + MLP(LN(x))."""

    def __init__(self, cfg: ModelConfig, recipe: Recipe, rngs: nnx.Rngs, dtype=jnp.bfloat16):
        d = cfg.d_model
        self.cfg = cfg
        self.qkv = fnnx.LayerNormDense(d, 3 * d, recipe=recipe, dtype=dtype, rngs=rngs)
        # GPT-2 style: the residual projections start smaller (std / sqrt(2 * n_layers)).
        small = nnx.initializers.variance_scaling(1.0 / (2 * cfg.n_layers), "fan_in", "truncated_normal")
        self.out = fnnx.Dense(d, d, recipe=recipe, dtype=dtype, kernel_init=small, rngs=rngs)
        self.mlp = fnnx.LayerNormMLP(d, cfg.mlp_ratio * d, recipe=recipe, activation="gelu", dtype=dtype, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        h, dh = self.cfg.n_heads, self.cfg.head_dim
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * h, dh), 3, axis=2)
        q, k = rope(q, self.cfg.rope_base), rope(k, self.cfg.rope_base)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # [B, T, H, Dh], bfloat16
        x = x + self.out(a.reshape(b, t, d))
        return x + self.mlp(x)


class GPT(nnx.Module):
    """Decoder-only language model: tokens int32 [B, T] -> logits float32 [B, T, vocab]."""

    def __init__(self, cfg: ModelConfig, recipe: Recipe, rngs: nnx.Rngs, dtype=jnp.bfloat16):
        self.cfg = cfg
        self.recipe = recipe
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=dtype,
                               embedding_init=nnx.initializers.normal(0.02), rngs=rngs)

        if cfg.scan_layers:  # parameters [n_layers, ...], each layer with its own init draws and rng streams
            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked(rngs):
                return Block(cfg, recipe, rngs, dtype)

            self.blocks = stacked(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, recipe, rngs, dtype) for _ in range(cfg.n_layers)])
        self.norm = nnx.LayerNorm(cfg.d_model, epsilon=1e-6, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        if self.cfg.scan_layers:
            x = _scan_blocks(x, self.blocks)
        else:
            for block in self.blocks:
                x = block(x)
        return self.head(self.norm(x)).astype(jnp.float32)


@nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
def _scan_blocks(x, block):
    return block(x)


def make_model(cfg: ModelConfig, recipe: Recipe, seed: int) -> GPT:
    return GPT(cfg, recipe, nnx.Rngs(params=seed, quantize=seed + 1))


def loss_fn(model: GPT, batch):
    """Mean next-byte cross-entropy (nats) of batch uint8/int32 [B, T + 1]."""
    batch = batch.astype(jnp.int32)
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@dataclasses.dataclass(frozen=True)
class OptConfig:
    lr: float = 3e-3
    warmup: int = 10
    steps: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    b2: float = 0.95
    final_lr_frac: float = 0.1


def make_optimizer(o: OptConfig) -> optax.GradientTransformation:
    """AdamW (decay on matrices only) after global-norm clipping, lr: linear warmup then cosine decay."""
    warmup = min(o.warmup, max(o.steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(0.0, o.lr, warmup, max(o.steps, warmup + 1),
                                                  end_value=o.lr * o.final_lr_frac)

    def decay_mask(params):  # decay the matrices (kernels, embedding), not biases or norm scales
        return jax.tree_util.tree_map_with_path(
            lambda path, _: any(getattr(k, "key", None) in ("kernel", "embedding") for k in path), params)

    return optax.chain(optax.clip_by_global_norm(o.clip),
                       optax.adamw(schedule, b1=0.9, b2=o.b2, weight_decay=o.weight_decay, mask=decay_mask))


def make_train_step(graphdef):
    """train_step(state, batch) -> (state, loss): ONE jax.jit of forward, backward (quantized GEMMs per the recipe,
    fresh stochastic-rounding keys from the layers' rng streams, whose counters live in `state`), clipping and the
    AdamW update, on the functional state (model, optimizer) of `nnx.split`. The loss is that of the parameters before
    the update; the input state's buffers are donated."""

    def train(state, batch):
        model, opt = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return nnx.state((model, opt)), loss

    return jax.jit(train, donate_argnums=0)


def build(cfg: ModelConfig, recipe: Recipe, opt_cfg: OptConfig, seed: int):
    """(graphdef, state, train_step) of a fresh model and its AdamW state."""
    model = make_model(cfg, recipe, seed)
    opt = nnx.Optimizer(model, make_optimizer(opt_cfg), wrt=nnx.Param)
    graphdef, state = nnx.split((model, opt))
    return graphdef, state, make_train_step(graphdef)


def count_params(cfg: ModelConfig) -> int:
    model = nnx.eval_shape(lambda: make_model(cfg, BF16(), 0))
    return sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
