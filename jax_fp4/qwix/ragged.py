"""`aligned_ragged_dot`: `jax_fp4.ragged_dot` on groups of any size, padded to the recipe's wgrad block.

A quantized wgrad blocks x and dy along each group's tokens, so `jax_fp4.ragged_dot` needs every group size to be a
multiple of the wgrad formats' block (16 NVFP4, 32 MXFP8; `jax_fp4.flax.moe.group_alignment`) when differentiated.
Models written for `jax.lax.ragged_dot` pass the router's counts as they are. This function moves every group's rows
into a buffer in which each group starts at a multiple of the alignment a (zero rows in between), runs the quantized
ragged_dot there with the padded sizes, and gathers the rows back: the layout of `jax_fp4.flax.moe.dispatch`
(group g at sum(padded sizes[:g]), capacity C = round_up(T + G*(a-1), a)), all on the device, no host sync. Zero
rows change no amax and encode to zero, so each group's quantization is that of the group alone. Rows of lhs past
sum(group_sizes) give zero rows, as in `jax.lax.ragged_dot`.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_fp4.flax.moe import group_alignment
from jax_fp4.grouped_gemm import ragged_dot
from jax_fp4.recipes import Recipe

__all__ = ["aligned_ragged_dot", "padded_rows"]


def padded_rows(group_sizes, num_rows: int, alignment: int):
    """(dest, padded_sizes, capacity): dest int32[num_rows] the buffer row of each lhs row (capacity for a row past
    sum(group_sizes): dropped), padded_sizes int32[G] the sizes rounded up to `alignment`, capacity (static)."""
    gs = group_sizes.astype(jnp.int32)
    g = gs.shape[0]
    sizes = (gs + alignment - 1) // alignment * alignment
    ends = jnp.cumsum(gs)
    starts, pstarts = ends - gs, jnp.cumsum(sizes) - sizes
    row = jnp.arange(num_rows, dtype=jnp.int32)
    gid = jnp.searchsorted(ends, row, side="right")
    capacity = -(-(num_rows + g * (alignment - 1)) // alignment) * alignment
    safe = jnp.minimum(gid, g - 1)
    dest = jnp.where(gid < g, pstarts[safe] + row - starts[safe], capacity).astype(jnp.int32)
    return dest, sizes, capacity


def aligned_ragged_dot(lhs, rhs, group_sizes, *, recipe: Recipe, key=None):
    """`jax_fp4.ragged_dot(lhs, rhs, group_sizes, recipe=recipe, key=key)` for group sizes that need not be
    multiples of the recipe's wgrad block (module docstring); the same when the recipe quantizes no wgrad operand.

    Args: lhs [T, K], rhs [G, K, N], group_sizes int[G] (traced or concrete; sum <= T), recipe, key: as
    `jax_fp4.ragged_dot`. Returns [T, N] (rows past sum(group_sizes) zero). Raises: as `jax_fp4.ragged_dot`.
    """
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
    a = group_alignment(recipe)
    if a == 1 or lhs.ndim != 2 or group_sizes.ndim != 1:  # (other ranks: ragged_dot's shape error)
        return ragged_dot(lhs, rhs, group_sizes, recipe=recipe, key=key)
    dest, sizes, capacity = padded_rows(group_sizes, lhs.shape[0], a)
    buf = jnp.zeros((capacity, lhs.shape[1]), lhs.dtype).at[dest].set(lhs, mode="drop")
    y = ragged_dot(buf, rhs, sizes, recipe=recipe, key=key)
    return y.at[dest].get(mode="fill", fill_value=0)
