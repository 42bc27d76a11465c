"""Expert parallelism: the per-device body of a mixture-of-experts MLP whose E experts are split over a mesh axis
(E / n per device), tokens moved to their experts' devices and back with fixed-capacity all-to-all collectives.

`expert_mlp` runs inside `jax.shard_map` (`jax_fp4.flax.moe_ep.ExpertParallelMoEMLP` builds the shard_map): every
device holds T_l tokens (the batch split over the mesh, the expert axis included) and the weights of its E / n local
experts. Per device and layer:

  plan      each (token, slot) assignment goes to device dest = e // (E / n), at position pos = its rank among
            this device's assignments to dest in (token, slot) order; kept when pos < C (the capacity per source and
            destination, `capacity`), else dropped (its term leaves the token's output; the kept weights are not
            renormalized). With the default C = T_l * k nothing is ever dropped (dropless).
  dispatch  a send buffer [n, C, D] (chunk j: the rows for device j, zero rows past its assignments) and the local
            expert of every row (int32 [n, C], E / n for an empty row) cross with `jax.lax.all_to_all` over the
            expert axis (split and concatenated on axis 0): device j receives [n, C, D], chunk i from device i.
  experts   the received rows are sorted by local expert into groups padded to the alignment (`group_rows`,
            stable: within a group the rows keep (source device, token, slot) order, i.e. the global token order
            when the batch is split contiguously), then up / activation / down through
            `jax_fp4.ragged_dot` with the recipe.
  combine   the expert outputs return in bfloat16 (the compute dtype) through the reverse all-to-all into the send
            positions; y[t] = sum_j p[t, j] * out[(t, j)] in float32, cast to the compute dtype (as MoEMLP).

Gradients: JAX differentiates the all-to-alls (the transpose of an all-to-all is the reverse all-to-all), so the
backward moves dy to the experts' devices and dx back, in the compute dtype. With ``quantized=True`` the up GEMM's x
and the down GEMM's dy cross as their quantized GEMM operands instead (`jax_fp4.expert_dispatch`).

Every expert group on its device holds the same rows, in the same order and with the same padding, as in the
unsharded `jax_fp4.flax.moe.MoEMLP` of the tokens of the devices along the expert axis: its quantization (per-group
tensor amax, the token-blocked wgrad operands) and its GEMM rows are those of the unsharded layer
(docs/numerics.md section 9).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_fp4 import expert_dispatch as ed
from jax_fp4.grouped_gemm import ragged_dot
from jax_fp4.recipes import Recipe

__all__ = ["SAVE_NAME", "capacity", "plan", "group_rows", "varying", "expert_mlp"]


#: `jax.checkpoint` name of the values that an all-to-all produced (the received local expert ids, the received rows of
#: the bf16 dispatch, the expert buffer's up-GEMM output, the combined rows): a remat policy that saves them
#: (`jax.checkpoint_policies.save_only_these_names(SAVE_NAME, ...)`) keeps the backward from repeating the forward's
#: all-to-alls.
SAVE_NAME = "jax_fp4_expert_parallel"


def capacity(tokens: int, top_k: int, n: int, capacity_factor: float | None = None) -> int:
    """Rows C of each (source, destination) chunk of the dispatch buffers.

    Args:
      tokens: T_l, the tokens of one device. top_k: k. n: the expert-axis size.
      capacity_factor: None (dropless: C = T_l * k, what one device sends when all its assignments go to one
        device) or cf > 0: C = min(T_l * k, ceil(cf * T_l * k / n)) (cf = 1: the balanced share; assignments past
        C of one (source, destination) pair are dropped, see the module docstring).

    Raises:
      ValueError: capacity_factor not a positive finite number.
    """
    full = tokens * top_k
    if capacity_factor is None:
        return full
    cf = float(capacity_factor)
    if not (cf > 0 and math.isfinite(cf)):
        raise ValueError(f"expert_parallel.capacity: capacity_factor must be None (dropless) or a positive number, "
                         f"got {capacity_factor!r}")
    return max(1, min(full, math.ceil(cf * full / n)))


def plan(experts, num_experts: int, n: int, cap: int):
    """Where every assignment of this device goes (module docstring, "plan").

    Args:
      experts: int32 [T_l, k] global expert ids. num_experts: E (a multiple of n). n: expert-axis size. cap: C.

    Returns:
      (slot, token, local): slot int32 [T_l, k] the send-buffer row (dest * C + pos) of each assignment, n * C when
      dropped; token int32 [n * C] the token of each send row (T_l for an empty row); local int32 [n * C] the local
      expert (e mod E / n) of each send row, E / n for an empty row.
    """
    t, k = experts.shape
    el = num_experts // n
    flat = experts.reshape(-1).astype(jnp.int32)
    dest = flat // el
    onehot = (dest[:, None] == jnp.arange(n, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    pos = jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - onehot, dest[:, None], axis=1)[:, 0]
    slot = jnp.where(pos < cap, dest * cap + pos, n * cap).astype(jnp.int32)
    token = jnp.full((n * cap + 1,), t, jnp.int32).at[slot].set(jnp.arange(t * k, dtype=jnp.int32) // k)[:-1]
    local = jnp.full((n * cap + 1,), el, jnp.int32).at[slot].set(flat % el)[:-1]
    return slot.reshape(t, k), token, local


def group_rows(group, num_groups: int, alignment: int):
    """Rows of a buffer holding the entries of `group` sorted by group, each group padded with zero rows to a
    multiple of `alignment` (stable: entries of one group keep their order). `jax_fp4.flax.moe.dispatch` for k = 1.

    Args:
      group: int32 [A] the group of every entry (values in [0, num_groups)).

    Returns:
      (rows int32 [A] each entry's buffer row, sizes int32 [num_groups] padded group sizes, capacity
      round_up(A + num_groups * (alignment - 1), alignment) (static)).
    """
    a = group.shape[0]
    order = jnp.argsort(group, stable=True)
    counts = jnp.bincount(group, length=num_groups).astype(jnp.int32)
    sizes = (counts + alignment - 1) // alignment * alignment
    starts, pstarts = jnp.cumsum(counts) - counts, jnp.cumsum(sizes) - sizes
    g = group[order]
    dest = (pstarts[g] + jnp.arange(a, dtype=jnp.int32) - starts[g]).astype(jnp.int32)
    rows = jnp.zeros((a,), jnp.int32).at[order].set(dest)
    return rows, sizes, -(-(a + num_groups * (alignment - 1)) // alignment) * alignment


def varying(a, axes):
    """`a` marked as varying over the mesh axes `axes` inside shard_map (`jax.lax.pcast(..., to="varying")`, or
    `jax.lax.pvary` where jax has no pcast): a replicated operand whose gradient then comes out summed over `axes`."""
    if not axes:
        return a
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(a, tuple(axes), to="varying")
    return jax.lax.pvary(a, tuple(axes))


def _exchange(a, axis_name, n):
    """all_to_all of a [n * C, ...] over `axis_name`: chunk j goes to device j, chunk i of the result came from
    device i."""
    c = a.shape[0] // n
    out = jax.lax.all_to_all(a.reshape(n, c, *a.shape[1:]), axis_name, 0, 0, tiled=True)
    return out.reshape(a.shape)


def expert_mlp(x2, weights, experts, up, down, *, recipe: Recipe, num_experts: int, axis_name: str,
               cap: int, alignment: int, activation: str = "swiglu", key=None, quantized: bool = False,
               implementation: str = "xla"):
    """One device's share of an expert-parallel MoE MLP (module docstring); call inside `jax.shard_map`.

    Args:
      x2: [T_l, D] this device's (normalized) tokens, in the compute dtype.
      weights: float32 [T_l, k] routing weights; experts: int32 [T_l, k] global expert ids (from the replicated
        router, `MoEMLP.route`).
      up: [E / n, D, H'] and down: [E / n, H, D_out] this device's experts (H' = 2H for SwiGLU: gate half first).
      recipe: the expert GEMMs' recipe (`jax_fp4.ragged_dot`). num_experts: E. axis_name: the expert mesh axis
        (size n). cap: C (`capacity`). alignment: the expert groups' row padding (`jax_fp4.flax.moe.group_alignment`).
      activation: "swiglu" or "gelu". key: stochastic-rounding key (None when the recipe needs none), folded with
        this device's index on the expert axis.
      quantized: dispatch the up GEMM's x and the down GEMM's dy as their quantized operands
        (`jax_fp4.expert_dispatch`; needs `expert_dispatch.quantized_dispatch(recipe)`); False: in x2's dtype.
      implementation: the grouped products' library, as `jax_fp4.ragged_dot`'s ("xla" or "tokamax").

    Returns:
      [T_l, D_out] in x2's dtype.

    Raises:
      ValueError: quantized with a recipe that does not quantize fprop x and dgrad dy.
    """
    if quantized and not ed.quantized_dispatch(recipe):
        raise ValueError(f"expert_mlp: recipe {recipe.name} does not quantize both the fprop x and the dgrad dy "
                         "operands: its dispatch cannot be quantized (quantized=False dispatches the compute dtype)")
    n = jax.lax.axis_size(axis_name)
    t, d = x2.shape
    k = experts.shape[1]
    el = num_experts // n
    slot, token, local = plan(experts, num_experts, n, cap)
    recv_local = checkpoint_name(_exchange(local, axis_name, n), SAVE_NAME)
    # Group the received rows by local expert (empty rows form a last group E / n that no GEMM reads).
    rows, sizes, buf = group_rows(recv_local, el + 1, alignment)
    src = jnp.full((buf,), n * cap, jnp.int32).at[rows].set(jnp.arange(n * cap, dtype=jnp.int32))
    sizes = sizes[:el]
    k_up = k_down = None
    if key is not None:
        k_up, k_down = jax.random.split(jax.random.fold_in(key, jax.lax.axis_index(axis_name)))
    if quantized:
        geom = ed.Geometry(n, cap, num_experts, k, t, buf, axis_name, implementation)
        a = t * k
        flat = slot.reshape(-1)
        sort_key = jnp.where(flat < n * cap, experts.reshape(-1), num_experts)  # dropped assignments sort last
        order = jnp.argsort(sort_key, stable=True).astype(jnp.int32)
        counts = jnp.bincount(sort_key, length=num_experts + 1)[:-1].astype(jnp.int32)
        srow = jnp.zeros((a,), jnp.int32).at[order].set(jnp.arange(a, dtype=jnp.int32))
        r = ed.Routing(order=order, counts=counts,
                       srow_of_slot=jnp.full((n * cap + 1,), a, jnp.int32).at[flat].set(srow)[:-1],
                       slot_of_srow=flat[order], token_of_slot=token, rows=rows, src=src, sizes=sizes)
        hid = ed.dispatch_up(recipe, geom, x2, up, r, k_up)
    else:
        send = jnp.concatenate([x2, jnp.zeros((1, d), x2.dtype)])[token]  # [n * C, D]; gradient: a scatter-add
        xs = jnp.concatenate([checkpoint_name(_exchange(send, axis_name, n), SAVE_NAME),
                              jnp.zeros((1, d), x2.dtype)])[src]
        hid = ragged_dot(xs, up, sizes, recipe=recipe, key=k_up, implementation=implementation)
    hid = checkpoint_name(hid, SAVE_NAME)
    if activation == "swiglu":
        gate, linear = jnp.split(hid, 2, axis=-1)
        hid = jax.nn.silu(gate) * linear
    else:
        hid = jax.nn.gelu(hid)
    if quantized:
        back = ed.down_combine(recipe, geom, hid, down, r, k_down)
    else:
        # [buf, D_out]; rows past the groups: 0
        out = ragged_dot(hid, down, sizes, recipe=recipe, key=k_down, implementation=implementation)
        back = _exchange(out[rows], axis_name, n)  # [n * C, D_out] in this device's send rows
    back = jnp.concatenate([checkpoint_name(back, SAVE_NAME), jnp.zeros((1, back.shape[1]), back.dtype)])
    return jnp.einsum("tk,tko->to", weights, back[slot].astype(jnp.float32)).astype(back.dtype)
