"""Quantized token dispatch of expert parallelism: the expert GEMMs' token operands cross the expert axis as their
quantized codes and block scales (`jax_fp4.expert_parallel.expert_mlp` with ``dispatch="quantized"``).

Two custom VJPs, each around "quantize -> all-to-all -> grouped GEMM" (run inside `jax.shard_map`, one call per
device; the routing indices come from `jax_fp4.expert_parallel.plan` / `group_rows`):

  `dispatch_up`    forward: each device quantizes its T_l * k assignment rows once, rowwise, as the up GEMM's fprop x
                   (``recipe.fprop_x``: NVFP4 codes + E4M3 block scales with the per-expert tensor amax, or MXFP8
                   codes + E8M0 scales); codes and scales cross in bytes (`jax_fp4.distributed` wire form: two E2M1
                   codes per byte) and the receiver reorders the rows into its expert groups and runs the fprop on
                   them as they are. The NVFP4 tensor amax of expert e is the max of |x| over the rows routed to e
                   from every device of the expert axis (each device's max, then `lax.pmax`): the amax the expert's
                   device would compute over its whole group, so the received operand is the unsharded layer's.
                   The weight gradient's x operand (columnwise, blocked along each group's tokens) cannot be
                   quantized before the rows meet: the receiver quantizes it from the dequantized fprop operand x^
                   (the values the forward used). Backward: dgrad and wgrad on the expert's device; dx returns
                   through the reverse all-to-all in the compute dtype and is summed per token.
  `down_combine`   forward: the down GEMM on the expert's device; its output returns to the tokens' devices in the
                   compute dtype (the combine stays bfloat16). Backward: each device quantizes the cotangent of its
                   returned rows (dy of the down GEMM, weighted by the routing probabilities) once, rowwise, as the
                   dgrad operand (``recipe.dgrad_dy``: MXFP8 for nvfp4-fwd-mxfp8-bwd; NVFP4 with the pmax-reduced
                   per-expert amax), sends codes and scales, and the expert's device runs dgrad on them; the
                   wgrad dy operand is quantized there from the dequantized dy^.

Bit for bit (docs/numerics.md "Expert parallelism"): the forward output, the dgrad products and thus dx and the
router / norm gradients equal those of the bf16 dispatch (and of the unsharded MoEMLP where that one does) for
recipes without stochastic rounding; the expert weight gradients use x^ and dy^ in place of x and dy.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_fp4._src.vjp_util import dtype_tag
from jax_fp4.dense import RESIDUAL_NAMES
from jax_fp4.distributed import _from_wire, _to_wire
from jax_fp4.grouped import grouped_dequantize, grouped_quantize
from jax_fp4.grouped_array import GroupedQuantizedArray
from jax_fp4.grouped_gemm import DGRAD_DIMS, FPROP_DIMS, WGRAD_DIMS, _grouped_pair, _product, _weight_pair
from jax_fp4.recipes import Recipe
from jax_fp4.reference import grouped as ref_grouped
from jax_fp4.validation import Representation

__all__ = ["Geometry", "Routing", "dispatch_up", "down_combine", "quantized_dispatch"]


def quantized_dispatch(recipe: Recipe) -> bool:
    """Whether a recipe's dispatch can be quantized: it quantizes the fprop x and the dgrad dy operands, neither with
    the RHT (the dispatch forms the tensor amax from |x| itself)."""
    fmts = (recipe.fprop_x, recipe.dgrad_dy)
    return all(f is not None and not getattr(f, "rht", False) for f in fmts)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static sizes of one device's dispatch: n (expert-axis size), cap (C), num_experts (E), top_k (k), tokens (T_l),
    buf (rows of the receiver's expert buffer), axis_name, implementation (the grouped products' library, as
    `jax_fp4.ragged_dot`'s)."""

    n: int
    cap: int
    num_experts: int
    top_k: int
    tokens: int
    buf: int
    axis_name: str
    implementation: str = "xla"

    @property
    def local(self) -> int:
        return self.num_experts // self.n


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """One device's routing indices (int32, traced):
      order [A]: the assignment (t * k + j) at each position of the expert-sorted order (A = T_l * k);
      counts [E]: kept assignments per global expert (dropped ones sort past them);
      srow_of_slot [n C]: the expert-sorted position of each send row (A: empty);
      slot_of_srow [A]: the send row of each expert-sorted position (n C: dropped);
      token_of_slot [n C]: the token of each send row (T_l: empty);
      rows [n C]: the receiver-buffer row of each received row; src [buf]: the received row of each buffer row (n C:
      padding); sizes [E / n]: the receiver's padded group sizes."""

    order: jax.Array
    counts: jax.Array
    srow_of_slot: jax.Array
    slot_of_srow: jax.Array
    token_of_slot: jax.Array
    rows: jax.Array
    src: jax.Array
    sizes: jax.Array


def _ext(a):
    """a with one zero row appended (the target of sentinel indices)."""
    return jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)])


def _exchange(a, g: Geometry):
    out = jax.lax.all_to_all(a.reshape(g.n, g.cap, *a.shape[1:]), g.axis_name, 0, 0, tiled=True)
    return out.reshape(a.shape)


def _expert_amax(rows, counts, g: Geometry):
    """float32 [E]: per global expert, the max |row| over its kept rows of the expert-sorted buffer `rows` [A, K] on
    every device of the expert axis (this device's max, then pmax)."""
    a = rows.shape[0]
    kept = jnp.sum(counts)
    expert = jnp.searchsorted(jnp.cumsum(counts), jnp.arange(a, dtype=counts.dtype), side="right")
    row_max = jnp.where(jnp.arange(a) < kept, jnp.max(jnp.abs(rows), axis=-1).astype(jnp.float32), 0.0)
    local = jnp.zeros((g.num_experts + 1,), jnp.float32).at[expert].max(row_max)[:-1]
    return jax.lax.pmax(local, g.axis_name)


def _send_quantized(rows, fmt, r: Routing, g: Geometry, key):
    """Quantize the expert-sorted rows [A, K] rowwise to `fmt` (groups = global experts; NVFP4 with the expert
    amaxes of `_expert_amax`), move them to the experts' devices, and return the receiver's GroupedQuantizedArray
    [buf, K] over its E / n padded groups."""
    a, k = rows.shape
    amax = _expert_amax(rows, r.counts, g) if fmt.has_tensor_amax else None
    sizes = jnp.concatenate([r.counts, jnp.array([a], r.counts.dtype) - jnp.sum(r.counts)])  # dropped: a last group
    q = grouped_quantize(rows, sizes, fmt, axis=-1, key=key,
                         amax=None if amax is None else jnp.concatenate([amax, jnp.ones((1,), jnp.float32)]))
    parts = []
    for leaf in (q.data.reshape(a, -1), q.scale.reshape(a, -1)):  # moved and reordered as bytes (wire form), so
        wire = _ext(_to_wire(leaf))[r.srow_of_slot]  # that the padding rows are byte 0 (E8M0 has no zero; 0 is 2^-127)
        parts.append(_from_wire(_ext(_exchange(wire, g))[r.src], leaf.dtype).reshape(-1))
    me = jax.lax.axis_index(g.axis_name)
    local_amax = None if amax is None else jax.lax.dynamic_slice(amax, (me * g.local,), (g.local,))
    cols = jnp.full((g.local,), k, jnp.int32)
    offsets = ref_grouped.group_offsets(r.sizes, cols)
    return GroupedQuantizedArray(parts[0], parts[1], local_amax, r.sizes, cols, offsets, fmt=fmt, axis=-1,
                                 representation=Representation.VARYING_FIRST_DIM, shape=(g.buf, k))


def _named(a, i):
    """a's leaves tagged with `jax_fp4.dense.RESIDUAL_NAMES[i]` (0: the wgrad x, 1: the dgrad w), as ragged_dot's."""
    return jax.tree.map(partial(checkpoint_name, name=RESIDUAL_NAMES[i]), a)


def _keys(key):
    return (None,) * 4 if key is None else tuple(jax.random.split(key, 4))


# ---- up: quantize -> all-to-all -> grouped GEMM ----------------------------------------------------------------------
@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def dispatch_up(recipe: Recipe, g: Geometry, x2, w, r: Routing, key):
    """The up GEMM of the received tokens: [buf, N] = ragged_dot(dispatched x2 rows, w [E / n, K, N], r.sizes) with
    the dispatch quantized (module docstring). x2: [T_l, K] this device's tokens."""
    return _up_fwd(recipe, g, x2, w, r, key)[0]


def _up_fwd(recipe, g, x2, w, r, key):
    kq, kx, kw, kdy = _keys(key)
    xq = _send_quantized(x2[r.order // g.top_k], recipe.fprop_x, r, g, kq)
    w_dgrad, w_fprop = _weight_pair(w, recipe.dgrad_w, recipe.fprop_w, kw)
    y = _product(xq, w_fprop, r.sizes, FPROP_DIMS, g.implementation).astype(jnp.result_type(x2, w))
    x_hat = grouped_dequantize(xq, x2.dtype)  # the values the fprop used, in the receiver's expert buffer
    x_wgrad = _grouped_pair(x_hat, r.sizes, None, recipe.wgrad_x, kx)[1]
    return y, (_named(x_wgrad, 0), _named(w_dgrad, 1), r, kdy, dtype_tag(x2), dtype_tag(w))


def _up_bwd(recipe, g, res, dy):
    x_wgrad, w_dgrad, r, kdy, xs, ws = res
    recipe.check_key(kdy, "ExpertParallelMoEMLP", backward=True)
    dy_dgrad, dy_wgrad = _grouped_pair(dy, r.sizes, recipe.dgrad_dy, recipe.wgrad_dy, kdy)
    dx_buf = _product(dy_dgrad, w_dgrad, r.sizes, DGRAD_DIMS, g.implementation).astype(xs.dtype)  # [buf, K]
    dx_send = _exchange(dx_buf[r.rows], g)  # back on the tokens' device, in its send rows
    dx2 = jnp.zeros((g.tokens + 1, dx_send.shape[1]), xs.dtype).at[r.token_of_slot].add(dx_send)[:-1]
    dw = _product(x_wgrad, dy_wgrad, r.sizes, WGRAD_DIMS, g.implementation).astype(ws.dtype)
    return dx2, dw, None, None


dispatch_up.defvjp(_up_fwd, _up_bwd)


# ---- down: grouped GEMM -> all-to-all (bf16); backward: quantize dy -> all-to-all -> dgrad --------------------------
@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def down_combine(recipe: Recipe, g: Geometry, h, w, r: Routing, key):
    """The down GEMM of the expert buffer h [buf, K] with w [E / n, K, N], returned to the tokens' devices: [n C, N]
    in their send rows, in h's dtype (module docstring)."""
    return _down_fwd(recipe, g, h, w, r, key)[0]


def _down_fwd(recipe, g, h, w, r, key):
    kq, kx, kw, kdy = _keys(key)
    h_fprop, h_wgrad = _grouped_pair(h, r.sizes, recipe.fprop_x, recipe.wgrad_x, kx)
    w_dgrad, w_fprop = _weight_pair(w, recipe.dgrad_w, recipe.fprop_w, kw)
    out = _product(h_fprop, w_fprop, r.sizes, FPROP_DIMS, g.implementation).astype(jnp.result_type(h, w))
    back = _exchange(out[r.rows], g)
    return back, (_named(h_wgrad, 0), _named(w_dgrad, 1), r, kq, kdy, dtype_tag(h), dtype_tag(w))


def _down_bwd(recipe, g, res, dback):
    h_wgrad, w_dgrad, r, kq, kdy, hs, ws = res
    recipe.check_key(kq, "ExpertParallelMoEMLP", backward=True)
    dyq = _send_quantized(_ext(dback)[r.slot_of_srow], recipe.dgrad_dy, r, g, kq)
    dh = _product(dyq, w_dgrad, r.sizes, DGRAD_DIMS, g.implementation).astype(hs.dtype)
    dy_hat = grouped_dequantize(dyq, dback.dtype)
    dy_wgrad = _grouped_pair(dy_hat, r.sizes, None, recipe.wgrad_dy, kdy)[1]
    dw = _product(h_wgrad, dy_wgrad, r.sizes, WGRAD_DIMS, g.implementation).astype(ws.dtype)
    return dh, dw, None, None


down_combine.defvjp(_down_fwd, _down_bwd)
