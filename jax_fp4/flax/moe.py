"""Flax NNX mixture-of-experts MLP whose expert GEMMs are quantized grouped GEMMs (`jax_fp4.ragged_dot`).

`MoEMLP`: y = sum_{e in top_k(x)} p_e(x) * down_e(act(up_e(norm(x)))), dropless (every token reaches its k experts).

  norm     optional pre-norm (`nnx.LayerNorm` / `nnx.RMSNorm`, unquantized), so the layer can replace
           `jax_fp4.flax.nnx.LayerNormMLP` in a pre-norm transformer block (x + MoEMLP(x)).
  router   `nnx.Linear(in, E, use_bias=False)` computing in bfloat16 (``router_dtype``); softmax over the E experts
           in float32, then the top_k probabilities, renormalized to sum to 1 (Mixtral's routing).
  dispatch the T*k (token, expert) assignments sorted by expert (stable argsort), each expert's group padded with
           zero rows to a multiple of ``group_alignment`` (the recipe's wgrad block, so the token-blocked wgrad
           operands hold whole blocks; Megatron's router padding for FP8), in a buffer of static capacity
           C = round_up(T*k + E*(alignment - 1), alignment): no token is dropped, no size reaches the host.
  experts  up [E, in, hidden] (2*hidden for SwiGLU: gate half first) and down [E, hidden, out], each a
           `jax_fp4.ragged_dot` over the padded groups with the recipe (fprop, dgrad and wgrad quantized; expert
           weights one tensor scale per expert; activations one per expert group).
  combine  y[t] = sum_j p[t, j] * out[row of (t, j)] in float32, cast to the compute dtype.

Parameters: ``norm`` {scale, bias}, ``router.kernel`` [in, E], ``up.kernel`` [E, in, hidden(*2)], ``down.kernel``
[E, hidden, out] (lecun-normal with fan-in per expert; float32 by default), no biases.

Load balancing: ``layer(x, return_aux_loss=True)`` also returns the Switch Transformer auxiliary loss
E * sum_e f_e * P_e (f_e the fraction of assignments routed to e, P_e the mean router probability of e; 1 when
balanced), to be added to the training loss with a small weight (e.g. 0.01).
"""

from __future__ import annotations

import math
import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, initializers

from jax_fp4._src.emulation.ragged import check_implementation
from jax_fp4.blocking import BlockingError
from jax_fp4.flax.layer_path import nnx_path
from jax_fp4.flax.nnx_layers import RngsLike, check_recipe, make_norm, quantize_key, quantize_stream, split_rngs
from jax_fp4.grouped_gemm import ragged_dot
from jax_fp4.recipes import Recipe

__all__ = ["MoEMLP", "Experts", "group_alignment", "dispatch"]

ACTIVATIONS = ("gelu", "swiglu")
default_expert_init = initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))


def group_alignment(recipe: Recipe) -> int:
    """Rows each expert group is padded to: the lcm of the block sizes of the recipe's wgrad operands (blocked along
    the tokens: 16 NVFP4, 32 MXFP8), 1 when wgrad is not quantized."""
    return math.lcm(*(f.block_size for f in (recipe.wgrad_x, recipe.wgrad_dy) if f is not None), 1)


def dispatch(expert_ids, num_experts: int, alignment: int):
    """Sort the assignments by expert into a padded buffer (all on the device; traced sizes).

    Args:
      expert_ids: int32[T, k] the experts of every token.
      num_experts: E. alignment: every group's size is rounded up to a multiple of it.

    Returns:
      (rows, sizes, capacity): rows int32[T, k] the buffer row of each assignment; sizes int32[E] the padded group
      sizes (sum <= capacity); capacity C = round_up(T*k + E*(alignment-1), alignment) (static). Rows of expert e
      are contiguous, in token order, starting at sum(sizes[:e]).
    """
    t, k = expert_ids.shape
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    sizes = (counts + alignment - 1) // alignment * alignment
    starts = jnp.cumsum(counts) - counts
    pstarts = jnp.cumsum(sizes) - sizes
    sorted_e = flat[order]
    dest_sorted = pstarts[sorted_e] + jnp.arange(t * k, dtype=jnp.int32) - starts[sorted_e]
    rows = jnp.zeros((t * k,), jnp.int32).at[order].set(dest_sorted.astype(jnp.int32))
    capacity = -(-(t * k + num_experts * (alignment - 1)) // alignment) * alignment
    return rows.reshape(t, k), sizes, capacity


class Experts(nnx.Module):
    """E stacked expert weights: ``kernel`` [E, in, out] (one GEMM per expert through `jax_fp4.ragged_dot`)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, kernel_init: tp.Callable,
                 param_dtype: tp.Any, rngs: nnx.Rngs):
        self.kernel = nnx.Param(kernel_init(rngs.params(), (num_experts, in_features, out_features), param_dtype))


class MoEMLP(nnx.Module):
    """Top-k routed mixture-of-experts MLP with quantized grouped expert GEMMs (see the module docstring).

    Args:
      in_features: the model width D.
      hidden_features: each expert's MLP width (per half for SwiGLU).
      num_experts: E.
      out_features: output width (default in_features).
      recipe: the `jax_fp4.recipes.Recipe` of the expert GEMMs (the x / dy formats must be grouped formats:
        BF16, MXFP8, NVFP4, NVFP4Fwd_MXFP8Bwd; NVFP4_1x64 raises). The router is never quantized.
      top_k: experts per token (default 2).
      activation: "swiglu" (default) or "gelu" (tanh approximation).
      norm: "layernorm" (default), "rmsnorm" or None (no pre-norm); epsilon: its epsilon.
      alignment: rows each expert group is padded to (default `group_alignment(recipe)`); must be a multiple of it.
      router_dtype: the router's compute dtype (default bfloat16); the softmax runs in float32.
      dtype: compute dtype of the experts (None: promoted from x and the params, as `nnx.Linear`).
      param_dtype: parameter dtype (default float32). kernel_init: expert init (fan-in per expert).
      rng_collection: stream of the stochastic-rounding keys when ``recipe.needs_key`` (as `jax_fp4.flax.nnx.Dense`).
      implementation: who computes the expert GEMMs, as `jax_fp4.ragged_dot`'s: "xla" (default) or "tokamax" (GPU
        grouped-GEMM kernels; needs `jax_fp4[tokamax]`). ValueError / ImportError at construction.
      rngs: `nnx.Rngs` (``params`` for the weights).

    Call: ``layer(x, *, rngs=None, return_aux_loss=False)``, x [..., D] -> [..., out] (and the float32 auxiliary
    load-balancing loss when asked). T = prod(x.shape[:-1]) tokens; the expert buffers hold C rows (above).

    Constraints (at trace time): D, hidden and out multiples of the recipe's blocks (32 for MXFP8, 16 for NVFP4):
    `jax_fp4.blocking.BlockingError` naming the projection (up / down), the operand role, the layer's module path
    ("blocks/0/moe") and the fixes; 1 <= top_k <= E (ValueError).
    """

    def __init__(self, in_features: int, hidden_features: int, num_experts: int, out_features: int | None = None, *,
                 recipe: Recipe, top_k: int = 2, activation: str = "swiglu", norm: str | None = "layernorm",
                 epsilon: float = 1e-6, alignment: int | None = None, router_dtype: tp.Any = jnp.bfloat16,
                 dtype: tp.Any = None, param_dtype: tp.Any = jnp.float32,
                 kernel_init: tp.Callable = default_expert_init, rng_collection: str = "quantize",
                 implementation: str = "xla", rngs: nnx.Rngs):
        recipe = check_recipe(recipe, "jax_fp4.flax.moe.MoEMLP")
        self.implementation = check_implementation(implementation, "jax_fp4.flax.moe.MoEMLP")
        if activation not in ACTIVATIONS:
            raise ValueError(f"MoEMLP: activation must be one of {ACTIVATIONS}, got {activation!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoEMLP: top_k = {top_k} must be in [1, num_experts = {num_experts}]")
        base = group_alignment(recipe)
        alignment = base if alignment is None else int(alignment)
        if alignment < 1 or alignment % base:
            raise ValueError(f"MoEMLP: alignment {alignment} must be a positive multiple of {base} (the block of "
                             f"recipe {recipe.name}'s token-blocked wgrad operands)")
        out_features = in_features if out_features is None else out_features
        self.recipe, self.top_k, self.num_experts, self.activation = recipe, top_k, num_experts, activation
        self.alignment, self.dtype, self.rng_collection = alignment, dtype, rng_collection
        self.hidden_features, self.out_features = hidden_features, out_features
        self.norm = (make_norm(norm, in_features, epsilon, dtype, param_dtype, rngs) if norm is not None
                     else nnx.data(None))
        self.router = nnx.Linear(in_features, num_experts, use_bias=False, dtype=router_dtype,
                                 param_dtype=param_dtype, rngs=rngs)
        up_width = hidden_features * (2 if activation == "swiglu" else 1)
        self.up = Experts(num_experts, in_features, up_width, kernel_init=kernel_init, param_dtype=param_dtype,
                          rngs=rngs)
        self.down = Experts(num_experts, hidden_features, out_features, kernel_init=kernel_init,
                            param_dtype=param_dtype, rngs=rngs)
        self.rngs: nnx.RngStream | None = quantize_stream(recipe, rngs, rng_collection, "MoEMLP")

    def route(self, x2):
        """Router of tokens x2 [T, D]: (probs float32 [T, E], top-k weights float32 [T, k], experts int32 [T, k])."""
        probs = jax.nn.softmax(self.router(x2).astype(jnp.float32), axis=-1)
        top_p, top_e = jax.lax.top_k(probs, self.top_k)
        return probs, top_p / jnp.sum(top_p, axis=-1, keepdims=True), top_e.astype(jnp.int32)

    def _expert_gemm(self, name, xs, w, sizes, key):
        """`ragged_dot` of projection `name` ("up" / "down"); a BlockingError names the projection's module path."""
        try:
            return ragged_dot(xs, w, sizes, recipe=self.recipe, key=key, implementation=self.implementation)
        except BlockingError as e:  # the policy unit is the MoE layer; the message names the projection
            raise e.with_layer(nnx_path(self) or type(self).__name__,
                               f"jax_fp4.flax.moe.MoEMLP, {name} projection (jax_fp4.ragged_dot)") from None

    def __call__(self, x: jax.Array, *, rngs: RngsLike = None, return_aux_loss: bool = False):
        lead, d = x.shape[:-1], x.shape[-1]
        h = self.norm(x) if self.norm is not None else x
        x2 = h.reshape(math.prod(lead), d)
        t = x2.shape[0]
        probs, weights, experts = self.route(x2)
        rows, sizes, capacity = dispatch(experts, self.num_experts, self.alignment)
        up, down = self.up.kernel[...], self.down.kernel[...]
        x2, up, down = dtypes.promote_dtype((x2, up, down), dtype=self.dtype)
        key = quantize_key(self, rngs, (x2, up, down))
        k_up, k_down = (None, None) if key is None else split_rngs(key, 2)
        # Token of every buffer row (t = padding: a zero row), then the gather (its gradient: a scatter-add).
        src = jnp.full((capacity,), t, jnp.int32).at[rows.reshape(-1)].set(
            jnp.repeat(jnp.arange(t, dtype=jnp.int32), self.top_k))
        xs = jnp.concatenate([x2, jnp.zeros((1, d), x2.dtype)])[src]
        hid = self._expert_gemm("up", xs, up, sizes, k_up)
        if self.activation == "swiglu":
            gate, linear = jnp.split(hid, 2, axis=-1)
            hid = jax.nn.silu(gate) * linear
        else:
            hid = jax.nn.gelu(hid)
        out = self._expert_gemm("down", hid, down, sizes, k_down)  # [C, out]
        y = jnp.einsum("tk,tko->to", weights, out[rows].astype(jnp.float32)).astype(out.dtype)
        y = y.reshape(*lead, self.out_features)
        if not return_aux_loss:
            return y
        frac = jnp.bincount(experts.reshape(-1), length=self.num_experts) / (t * self.top_k)
        aux = self.num_experts * jnp.sum(frac * jnp.mean(probs, axis=0))
        return y, aux
