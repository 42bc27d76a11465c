"""Building blocks of train_lm's models (examples/lm/lm_model.py): rotary embedding, attention, the Llama-style block,
sharding annotations and activation checkpointing (remat) policies.

LlamaBlock (the ``arch="llama"`` block): x + out(attention(qkv(RMSNorm(x)))), then x + down(SwiGLU(up(RMSNorm(x)))),
no biases, grouped-query attention (``kv_heads`` key / value heads shared by n_heads / kv_heads query heads each),
rotary positions on q and k, `jax.nn.dot_product_attention` (cuDNN's fused kernel on a GPU; XLA's with
``attention="xla"``, as `--deterministic` sets). qkv, out, up and down
are `jax_fp4.flax.nnx.Dense` layers following the recipe; the norms, rope, attention and SwiGLU run in bfloat16.
Column orders chosen so that a column shard over "tensor" holds whole heads and whole SwiGLU pairs:
  * qkv [d, (n_heads + 2 kv_heads) * head_dim]: kv-group major: for each kv group g, its n_heads / kv_heads query
    heads, then k_g, then v_g. A tensor shard (kv_heads % tensor == 0) holds whole groups: no head moves.
  * up [d, 2 * hidden]: in chunks of 64 columns alternating gate / linear (gate chunk j = columns [128 j, 128 j + 64),
    linear chunk j the next 64); h = silu(gate) * linear. Quantization blocks (16, 32, 64 wide) stay within one half
    and a shard of whole 128-column pairs holds matching gate and linear columns.

Activation checkpointing (``remat``), per block (`remat_policy`):
  * "none": every residual kept (no recomputation).
  * "quantized": `jax.checkpoint` saving the GEMMs' weight-gradient operands only: for quantized layers the names
    `jax_fp4.dense` gives its quantized residuals (`jax_fp4.dense.RESIDUAL_NAMES`: the columnwise-quantized x of
    wgrad, the rowwise-quantized weight of dgrad), for unquantized (bf16) layers the input x tagged `GEMM_INPUT` by
    LlamaBlock. The backward recomputes the norms, rope, attention, SwiGLU and the qkv / up GEMMs whose outputs they
    need (the out / down outputs only feed residual sums); nothing is quantized twice for the weight gradients.
    Expert-parallel MoE layers also keep what their all-to-alls produced (`jax_fp4.expert_parallel.SAVE_NAME`), so
    the backward repeats no collective.
    GPT blocks tag no bf16 input: there "quantized" keeps the quantized residuals and recomputes bf16 layers' inputs.
  * "full": `jax.checkpoint` saving nothing but the block's input (the whole block recomputed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from lm_mesh import heads_sharding, param_axes
from lm_moe import make_moe, moe_call

from jax_fp4 import determinism
from jax_fp4.dense import RESIDUAL_NAMES
from jax_fp4.expert_parallel import SAVE_NAME as EXPERT_PARALLEL_SAVED
from jax_fp4.flax import nnx as fnnx

REMAT = ("none", "quantized", "full")
GEMM_INPUT = "lm_gemm_input"  # the checkpoint name of a bf16 GEMM's input x (its weight-gradient operand)
SWIGLU_CHUNK = 64


def remat_policy(name: str):
    """The `jax.checkpoint` policy of a REMAT name (None for "none"); ValueError for another name."""
    if name == "none":
        return None
    if name == "quantized":
        return jax.checkpoint_policies.save_only_these_names(*RESIDUAL_NAMES, GEMM_INPUT, EXPERT_PARALLEL_SAVED)
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    raise ValueError(f"remat must be one of {REMAT}, got {name!r}")


ATTENTION = ("auto", "xla", "cudnn")  # ModelConfig.attention


def attention_implementation(choice: str = "auto"):
    """The `jax.nn.dot_product_attention` implementation of ModelConfig.attention `choice`: "auto" and "cudnn":
    "cudnn" (the fused flash-attention kernel) when the default backend is a GPU, else None (XLA's); "xla": XLA's
    everywhere (what `--deterministic` takes unless `--attention cudnn`:
    `jax_fp4.determinism.attention_implementation`). "cudnn" differs from "auto" only in what train_lm checks: under
    deterministic ops it is refused where XLA aborts (a quantized step over several devices)."""
    if choice not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {choice!r}")
    return determinism.attention_implementation(choice == "xla")


def rope(x, base):
    """Rotary position embedding of x [B, T, H, Dh] (pairs (i, i + Dh/2) rotated by position / base^(2i/Dh))."""
    _, t, _, dh = x.shape
    inv = base ** (-jnp.arange(0, dh // 2, dtype=jnp.float32) * 2.0 / dh)
    ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]  # [T, Dh/2]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def annotate(init, kind, mesh):
    """init with the mesh axes of `lm_mesh.param_axes(kind)` attached (`nnx.with_partitioning`), or init itself
    without a mesh."""
    return init if mesh is None else nnx.with_partitioning(init, param_axes(kind, mesh), mesh=mesh)


def attention(q, k, v, mesh, implementation: str = "auto", site: int | None = None):
    """Causal attention of q [B, T, H, Dh] over k, v [B, T, KV, Dh] (H a multiple of KV: grouped queries), bfloat16
    [B, T, H, Dh]; with a mesh q, k, v are constrained to heads split over "tensor". implementation: ATTENTION (see
    `attention_implementation`). site: this call site's index when the step's call sites must build distinct cuDNN
    graphs (`jax_fp4.determinism.distinct_causal_window`: the same values), None for plain causal attention."""
    if mesh is not None:
        q, k, v = (jax.lax.with_sharding_constraint(a, heads_sharding(mesh)) for a in (q, k, v))
    window = None if site is None else determinism.distinct_causal_window(q.shape[1], site)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=window,
                                        implementation=attention_implementation(implementation))


def _gemm_input(layer, h):
    """h, tagged GEMM_INPUT when `layer`'s recipe quantizes nothing (its bf16 x is the weight-gradient operand)."""
    return h if layer.recipe.quantized else checkpoint_name(h, GEMM_INPUT)


class LlamaBlock(nnx.Module):
    """Pre-norm Llama block (see the module docstring). cfg: lm_model.ModelConfig with arch "llama"."""

    def __init__(self, cfg, recipe, rngs: nnx.Rngs, dtype=jnp.bfloat16, mesh=None):
        d, hd, h, kv = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.kv
        self.cfg, self.mesh = cfg, mesh
        init = fnnx.default_kernel_init
        # the residual projections start smaller (std / sqrt(2 * n_layers), as GPT-2 and Megatron)
        small = nnx.initializers.variance_scaling(1.0 / (2 * cfg.n_layers), "fan_in", "truncated_normal")
        norm = dict(epsilon=1e-6, dtype=dtype, rngs=rngs)  # scales replicated
        dense = dict(recipe=recipe, use_bias=False, dtype=dtype, rngs=rngs)
        self.attention_site = None  # set by lm_model.GPT when ModelConfig.distinct_attention
        self.attn_norm = nnx.RMSNorm(d, **norm)
        self.qkv = fnnx.Dense(d, (h + 2 * kv) * hd, kernel_init=annotate(init, "col", mesh), **dense)
        self.out = fnnx.Dense(h * hd, d, kernel_init=annotate(small, "row", mesh), **dense)
        if cfg.moe:  # pre-norm RMSNorm, SwiGLU experts of width cfg.hidden (lm_moe.make_moe)
            self.mlp = make_moe(cfg, recipe, rngs, dtype, mesh, activation="swiglu", norm="rmsnorm",
                                hidden=cfg.hidden)
            return
        self.mlp_norm = nnx.RMSNorm(d, **norm)
        self.up = fnnx.Dense(d, 2 * cfg.hidden, kernel_init=annotate(init, "col", mesh), **dense)
        self.down = fnnx.Dense(cfg.hidden, d, kernel_init=annotate(small, "row", mesh), **dense)

    def __call__(self, x):
        """(x [B, T, d] after the block, float32 0: no load-balancing loss; MoE: `lm_model.moe_call`'s aux)."""
        b, t, d = x.shape
        h, kv, dh = self.cfg.n_heads, self.cfg.kv, self.cfg.head_dim
        y = self.attn_norm(x)
        qkv = self.qkv(_gemm_input(self.qkv, y)).reshape(b, t, kv, h // kv + 2, dh)
        q = qkv[:, :, :, :-2].reshape(b, t, h, dh)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        q, k = rope(q, self.cfg.rope_base), rope(k, self.cfg.rope_base)
        a = attention(q, k, v, self.mesh, self.cfg.attention, self.attention_site).reshape(b, t, h * dh)
        x = x + self.out(_gemm_input(self.out, a))
        if self.cfg.moe:
            y, aux = moe_call(self.mlp, x)
            return x + y, aux
        y = self.mlp_norm(x)
        u = self.up(_gemm_input(self.up, y)).reshape(b, t, -1, 2, SWIGLU_CHUNK)
        g = (jax.nn.silu(u[:, :, :, 0]) * u[:, :, :, 1]).reshape(b, t, self.cfg.hidden)
        return x + self.down(_gemm_input(self.down, g)), jnp.zeros((), jnp.float32)


__all__ = ["REMAT", "ATTENTION", "GEMM_INPUT", "remat_policy", "attention_implementation", "rope", "annotate",
           "attention", "LlamaBlock"]
