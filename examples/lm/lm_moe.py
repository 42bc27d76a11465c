"""The mixture-of-experts MLPs of train_lm's models (examples/lm/lm_model.py, lm_layers.py).

`make_moe` builds a block's MoE MLP: `jax_fp4.flax.moe.MoEMLP` (experts replicated: one device, or data / fsdp
parallel), or on a mesh whose "expert" axis is larger than 1 `jax_fp4.flax.moe_ep.ExpertParallelMoEMLP` (the experts
split over "expert", the tokens of the batch axes ("data", "fsdp", "expert") dispatched to them by all-to-all;
quantized dispatch where the recipe quantizes the fprop x and dgrad dy operands). Both have the same parameters, so a
checkpoint resumes on either (and on another expert-axis size).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from lm_mesh import BATCH, EXPERT

from jax_fp4.flax.moe import MoEMLP
from jax_fp4.flax.moe_ep import ExpertParallelMoEMLP
from jax_fp4.formats import NVFP4 as NVFP4Format
from jax_fp4.recipes import Recipe

__all__ = ["expert_recipe", "make_moe", "moe_call"]


def expert_recipe(recipe: Recipe) -> Recipe:
    """The recipe of the MoE expert GEMMs: `recipe`, except that a grouped (token) operand grouped quantize cannot
    encode (NVFP4 1x64: single-tensor only) becomes 1D NVFP4; the expert weights (quantized per expert) keep theirs.
    Only nvfp4-1x64 changes: its fprop x then uses 1x16 blocks with one tensor scale per expert group."""
    fmts = {}
    for name in ("fprop_x", "wgrad_x", "dgrad_dy", "wgrad_dy"):
        f = getattr(recipe, name)
        if isinstance(f, NVFP4Format) and (f.local_1x64 or f.scaling_2d):
            fmts[name] = f.replace(local_1x64=False, scaling_2d=False)
    return dataclasses.replace(recipe, name=f"{recipe.name}-experts", **fmts) if fmts else recipe


def make_moe(cfg, recipe: Recipe, rngs, dtype, mesh, *, activation: str, norm: str, hidden: int):
    """The MoE MLP of one block: cfg.moe_experts experts of width `hidden`, top cfg.moe_top_k, pre-norm `norm`
    ("layernorm" / "rmsnorm"), `activation` ("gelu" / "swiglu"), the recipe's `expert_recipe`, the expert GEMMs
    computed by cfg.moe_gemm ("xla" / "tokamax"); expert-parallel when
    `mesh` has an "expert" axis of size > 1 (dropless unless cfg.moe_capacity > 0, the capacity factor)."""
    kw = dict(recipe=expert_recipe(recipe), top_k=cfg.moe_top_k, activation=activation, norm=norm, dtype=dtype,
              implementation=cfg.moe_gemm, rngs=rngs)
    if mesh is None or mesh.shape.get(EXPERT, 1) == 1:
        return MoEMLP(cfg.d_model, hidden, cfg.moe_experts, **kw)
    return ExpertParallelMoEMLP(cfg.d_model, hidden, cfg.moe_experts, mesh=mesh, expert_axis=EXPERT,
                                batch_axes=BATCH, capacity_factor=cfg.moe_capacity or None, **kw)


def moe_call(mlp, x):
    """(y, aux) of an MoE MLP on x [B, T, d]: aux float32 [1 + E] holds the load-balancing loss, then the fraction of
    the token assignments routed to each of the E experts (the load; `lm_model.GPT` averages both over the blocks).
    The load comes from the router run again on the normalized tokens (no gradient; XLA may share it)."""
    y, aux = mlp(x, return_aux_loss=True)
    _, _, experts = mlp.route(jax.lax.stop_gradient(mlp.norm(x).reshape(-1, x.shape[-1])))
    load = jnp.bincount(experts.reshape(-1), length=mlp.num_experts) / experts.size
    return y, jnp.concatenate([aux[None], load.astype(jnp.float32)])
