"""Quantized grouped GEMM `ragged_dot` (MoE expert projections) with a custom VJP following a `Recipe`.

y[t] = lhs[t] @ rhs[g] for every row t of group g, as `jax.lax.ragged_dot`: lhs [T, K] holds the tokens sorted by
expert (group_sizes[g] rows each, rows past sum(group_sizes) give 0), rhs [G, K, N] one weight per expert. Group
sizes outside lax.ragged_dot's domain (a negative size, a sum past T) follow `clip_group_sizes` (a negative size
counts as 0, rows past T are cut off) in the value and the gradient alike.

The three GEMMs and their operands (x = lhs, w = rhs, dy the cotangent of y; the recipe fields in brackets):
  fprop  y     = ragged_dot(x, w)        x [fprop_x] blocks along K, w [fprop_w] blocks along K
  dgrad  dx    = ragged_dot(dy, w^T)     dy [dgrad_dy] blocks along N, w [dgrad_w] blocks along N
  wgrad  dw[g] = x_g^T dy_g              x [wgrad_x] and dy [wgrad_dy] blocked along the tokens of each group
wgrad is the transpose `jax.lax.ragged_dot` itself uses for rhs: a `ragged_dot_general` whose ragged dimension
(tokens) is contracted, giving one [K, N] product per group.

Quantization: x and dy are grouped tensors (VARYING_FIRST_DIM over the token groups), each quantized once in both
orientations by `grouped_quantize_rowwise_columnwise` (one tensor scale per group: docs/numerics.md section 4); w is
quantized per expert by `jax.vmap(quantize_rowwise_columnwise)` (one tensor scale per expert; every single-tensor
format, NVFP4's 16x16 2D weight blocks included). The residuals are the *quantized* wgrad x (grouped) and dgrad w
(per expert), tagged "jax_fp4_x_wgrad" / "jax_fp4_w_dgrad" as in `jax_fp4.dense`, plus group_sizes.

Emulation (docs/numerics.md "GEMM emulation", as `scaled_dot_general`): each operand becomes its exact block-scaled
values (value(q) * s_b, exact in bfloat16), the ragged product accumulates in float32 (Precision.HIGHEST), and
the NVFP4 tensor scales amax/2688 of the row's group (fprop, dgrad) or of the group (wgrad) multiply the float32
result, lhs's first. RHT pairs (wgrad) cancel inside each 16-chunk of tokens, which lies in one group when the
groups are aligned (below).

Randomness: key -> (kx, kw, kdy) = jax.random.split(key, 3); x and dy as `grouped_quantize_rowwise_columnwise`
(split into rowwise / columnwise keys, folded with the group index); w: expert g uses jax.random.split(kw, G)[g].

Alignment: wgrad blocks run along each group's tokens, so with a quantized wgrad every group size must be a multiple
of the wgrad formats' block size (16 NVFP4, 32 MXFP8): pad the groups (`jax_fp4.flax.moe` does) with zero rows.
Concrete group sizes (numpy / Python values, known at trace time) are checked at trace time: a differentiated call
with a misaligned group raises ValueError naming the group. Traced sizes (a router's counts under jit) are checked on
the device (no host sync): a misaligned group's dw is NaN (its quantized wgrad operands are poisoned, see
`jax_fp4.reference.grouped`), never silently wrong. fprop and dgrad have no constraint on the group sizes, and a
forward-only call quantizes no wgrad operand, so inference needs no padding.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jax_fp4 import blocking as _blocking
from jax_fp4 import validation
from jax_fp4._src.emulation.ragged import check_implementation, ragged_dot_plain, ragged_product
from jax_fp4._src.vjp_util import dtype_tag, operand_keys, refuse_forward_mode, reverse_mode_only
from jax_fp4.dense import RESIDUAL_NAMES
from jax_fp4.gemm import exact_operand
from jax_fp4.grouped import grouped_dequantize, grouped_quantize_rowwise_columnwise
from jax_fp4.grouped_array import GroupedQuantizedArray
from jax_fp4.quantize import quantize_rowwise_columnwise
from jax_fp4.quantized_array import QuantizedArray
from jax_fp4.recipes import Recipe, resolve
from jax_fp4.reference.nvfp4 import tensor_decode_scale

__all__ = ["ragged_dot", "clip_group_sizes", "grouped_exact_operand", "FPROP_DIMS", "DGRAD_DIMS", "WGRAD_DIMS"]

# x[T, K] . w[G, K, N] -> [T, N]; dy[T, N] . w[G, K, N] over N -> [T, K]; x[T, K] . dy[T, N] over T -> [G, K, N].
FPROP_DIMS = lax.RaggedDotDimensionNumbers(((([1], [1])), ([], [])), [0], [0])
DGRAD_DIMS = lax.RaggedDotDimensionNumbers(((([1], [2])), ([], [])), [0], [0])
WGRAD_DIMS = lax.RaggedDotDimensionNumbers(((([0], [0])), ([], [])), [0], [])
_GROUPED_OPERANDS = ("fprop_x", "wgrad_x", "dgrad_dy", "wgrad_dy")


def grouped_exact_operand(gq: GroupedQuantizedArray):
    """(values, tensor_scale) of a grouped operand: values bfloat16 of gq.shape holding value(q) * s_b exactly (the
    RHT domain for RHT formats), tensor_scale float32[N] = amax * fp32(1/2688) (NVFP4) or None (MXFP8), so that
    group g's dequantize is values * tensor_scale[g] up to the roundings of that product."""
    v = grouped_dequantize(gq, jnp.bfloat16, raw=True)  # MXFP8: saturated to the bfloat16 range
    return v, (tensor_decode_scale(gq.amax, gq.fmt.global_e4m3_max) if gq.amax is not None else None)


def _values(op):
    """(values, per-group tensor scale or None) of an operand: grouped, per-expert quantized, or a plain array."""
    if isinstance(op, GroupedQuantizedArray):
        return grouped_exact_operand(op)
    if isinstance(op, QuantizedArray):
        return jax.vmap(exact_operand)(op)
    return op, None


def _product(a, b, group_sizes, dims, implementation="xla"):
    quantized = not isinstance(a, jax.Array) or not isinstance(b, jax.Array)
    if quantized:  # keep the quantize producers out of the decode fusions (see gemm.py)
        a, b = lax.optimization_barrier((a, b))
    (va, ta), (vb, tb) = _values(a), _values(b)
    dt = jnp.float32 if jnp.float32 in (va.dtype, vb.dtype) else jnp.bfloat16
    out = ragged_product(va.astype(dt), vb.astype(dt), group_sizes, dims, implementation=implementation,
                         precision=lax.Precision.HIGHEST if quantized else None)
    if dims is WGRAD_DIMS:  # [G, K, N]: one scale per group
        for t in (ta, tb):
            if t is not None:
                out = out * t[:, None, None]
        return out
    gid = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(out.shape[0], dtype=group_sizes.dtype), side="right")
    for t in (ta, tb):  # rows: the scale of the row's group (rows past the groups are 0 and keep scale 1)
        if t is not None:
            out = out * jnp.concatenate([t, jnp.ones((1,), jnp.float32)])[gid][:, None]
    return out


def _grouped_pair(a, group_sizes, row_fmt, col_fmt, key):
    """(rowwise, columnwise) grouped quantizations of a [T, C] over the token groups; `a` where not quantized."""
    if row_fmt is None and col_fmt is None:
        return a, a
    row, col, _ = grouped_quantize_rowwise_columnwise(a, group_sizes, row_fmt, col_fmt, key=key)
    return (a if row is None else row), (a if col is None else col)


def _weight_pair(w, row_fmt, col_fmt, key):
    """(blocks along N, blocks along K) quantizations of every expert's w[g] [K, N]; `w` where not quantized."""
    if row_fmt is None and col_fmt is None:
        return w, w
    sr = [f for f in (row_fmt, col_fmt) if getattr(f, "stochastic_rounding", False)]
    keys = jax.random.split(key, w.shape[0]) if (sr and key is not None) else None

    def one(wg, kg):
        return quantize_rowwise_columnwise(wg, row_fmt, col_fmt, key=kg)[:2]

    row, col = jax.vmap(one)(w, keys) if keys is not None else jax.vmap(lambda wg: one(wg, None))(w)
    return (w if row is None else row), (w if col is None else col)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ragged(recipe, impl, x, w, group_sizes, key):
    """Forward only (no VJP taken): only the fprop operands are quantized, no residuals."""
    kx, kw, _ = operand_keys(key)
    x_fprop, _ = _grouped_pair(x, group_sizes, recipe.fprop_x, None, kx)
    _, w_fprop = _weight_pair(w, None, recipe.fprop_w, kw)
    return _product(x_fprop, w_fprop, group_sizes, FPROP_DIMS, impl).astype(jnp.result_type(x, w))


def _ragged_fwd(recipe, impl, x, w, group_sizes, key):
    _blocking.check_grouped(recipe, x.shape[0], x.shape[1], w.shape[2], validation._concrete(group_sizes),
                            differentiated=True)
    kx, kw, kdy = operand_keys(key)  # dY's key is checked by the backward (as in jax_fp4.dense)
    x_fprop, x_wgrad = _grouped_pair(x, group_sizes, recipe.fprop_x, recipe.wgrad_x, kx)
    w_dgrad, w_fprop = _weight_pair(w, recipe.dgrad_w, recipe.fprop_w, kw)
    y = _product(x_fprop, w_fprop, group_sizes, FPROP_DIMS, impl)
    res = (jax.tree.map(partial(checkpoint_name, name=RESIDUAL_NAMES[0]), x_wgrad),
           jax.tree.map(partial(checkpoint_name, name=RESIDUAL_NAMES[1]), w_dgrad),
           group_sizes, kdy, dtype_tag(x), dtype_tag(w))
    return y.astype(jnp.result_type(x, w)), res


def _ragged_bwd(recipe, impl, res, dy):
    x_wgrad, w_dgrad, group_sizes, kdy, xs, ws = res
    recipe.check_key(kdy, "ragged_dot", backward=True)
    dy_dgrad, dy_wgrad = _grouped_pair(dy, group_sizes, recipe.dgrad_dy, recipe.wgrad_dy, kdy)
    dx = _product(dy_dgrad, w_dgrad, group_sizes, DGRAD_DIMS, impl).astype(xs.dtype)
    dw = _product(x_wgrad, dy_wgrad, group_sizes, WGRAD_DIMS, impl).astype(ws.dtype)
    return dx, dw, None, None


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def _check(lhs, rhs, group_sizes, recipe):
    where = (f"ragged_dot: lhs {lhs.dtype}{list(lhs.shape)}, rhs {rhs.dtype}{list(rhs.shape)}, group_sizes "
             f"{group_sizes.dtype}{list(group_sizes.shape)}")
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"{where}: expected lhs [T, K] and rhs [G, K, N]")
    if group_sizes.shape != (rhs.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{where}: group_sizes must be int[G] with G = rhs.shape[0] = {rhs.shape[0]}")
    for name in _GROUPED_OPERANDS:
        fmt = getattr(recipe, name)
        if fmt is not None:
            try:
                validation.check_format(fmt, key=True, what="ragged_dot")
            except ValueError as e:
                raise ValueError(f"{where}: recipe {recipe.name}'s {name} = {fmt!r} cannot quantize the grouped "
                                 f"tokens ({e})") from None


def clip_group_sizes(group_sizes, rows: int):
    """The group sizes `ragged_dot` computes with: a negative size counts as 0 and groups past `rows` are cut off,
    i.e. group g holds the rows [min(rows, S[g-1]), min(rows, S[g])), S the running sum of max(size, 0). The
    identity on sizes >= 0 that sum to <= rows (where `jax.lax.ragged_dot` defines its result)."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), rows)
    return jnp.diff(ends, prepend=jnp.zeros((1,), ends.dtype)).astype(group_sizes.dtype)


def ragged_dot(lhs, rhs, group_sizes, *, recipe: Recipe, key=None, implementation: str = "xla"):
    """`jax.lax.ragged_dot(lhs, rhs, group_sizes)` with the GEMMs quantized as `recipe` says (custom VJP, module
    docstring).

    Args:
      lhs: bfloat16 / float16 / float32 [T, K], the rows of group g contiguous (tokens sorted by expert).
      rhs: [G, K, N] (same float dtypes), one weight per group.
      group_sizes: int[G] rows per group (traced: a router's counts); rows past their sum give 0. Sizes >= 0 that
        sum to <= T are used as given (`jax.lax.ragged_dot`'s domain, where BF16 gives its bits); otherwise a
        negative size counts as 0 and groups past row T are cut off (`clip_group_sizes`), in the value and in the
        gradient alike, traced or concrete.
      recipe: a `jax_fp4.recipes.Recipe` or its name (`recipes.by_name`); `recipes.BF16()` calls
        `jax.lax.ragged_dot` unchanged (same bits, same gradients). Its x / dy formats must be grouped formats
        (NVFP4 1D, RHT, SR; MXFP8): NVFP4_1x64 raises.
      key: PRNG key for stochastic rounding: required when an fprop operand rounds stochastically, or when the call
        is differentiated with a recipe that rounds a gradient operand stochastically. Forward-only calls quantize
        only the fprop operands (x rowwise, w along K) and need no key otherwise. Reverse mode only (jax.jvp /
        jacfwd / hessian raise TypeError).
      implementation: who computes the grouped products: "xla" (`jax.lax.ragged_dot_general`; XLA:GPU lowers it
        to a dense dot over every group) or "tokamax" (its GPU grouped-GEMM kernels; the same operands and
        float32 accumulation; needs `jax_fp4[tokamax]`). `jax_fp4._src.emulation.ragged` says more.

    Returns:
      [T, N] in the promoted dtype of lhs and rhs (float32 accumulation and tensor scales, then one cast).

    Raises:
      ValueError: shapes that do not line up; group_sizes not int[G]; a missing key; an unknown implementation.
      ImportError: implementation="tokamax" without tokamax.
      `jax_fp4.blocking.BlockingError` (a ValueError naming each operand role, the dimension or group and the
      fixes; `jax_fp4.flax.moe.MoEMLP` adds its layer path): formats that cannot block the shapes (K and N
      multiples of the formats' blocks, 16 for NVFP4 2D weights); when differentiated with a quantized wgrad,
      concrete group sizes that are not multiples of the wgrad formats' block size. Traced misaligned group sizes
      do not raise: that group's dw is NaN (module docstring).
    """
    recipe = resolve(recipe, "ragged_dot")
    check_implementation(implementation, "jax_fp4.ragged_dot")
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
    if recipe.quantized:  # before the other checks: one error whatever the key
        refuse_forward_mode("jax_fp4.ragged_dot", lhs, rhs)
    _check(lhs, rhs, group_sizes, recipe)
    recipe.check_key(key, "ragged_dot", backward=False)  # (a non-key is refused under BF16 too)
    group_sizes = clip_group_sizes(group_sizes, lhs.shape[0])  # one contract for the value and the gradient
    if not recipe.quantized:
        return ragged_dot_plain(lhs, rhs, group_sizes, implementation)
    _blocking.check_grouped(recipe, *lhs.shape, rhs.shape[2], differentiated=False)
    return reverse_mode_only(_ragged, "jax_fp4.ragged_dot")(recipe, implementation, lhs, rhs, group_sizes, key)
