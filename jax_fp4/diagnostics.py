"""Quantization diagnostics: how much of each GEMM operand survives its block-scaled quantization.

For an operand x and its quantization q (the `QuantizedArray` that `jax_fp4.quantize` / `quantize_rowwise_columnwise`
give, so exactly the bits the GEMM consumes; x̂ = `jax_fp4.dequantize(q)`), `quantization_stats` returns float32[6]
in the order of `STATS`:

  snr_db           10 log10(sum x² / sum (x - x̂)²) in dB (+inf when x̂ == x; NaN for an all-zero x)
  saturated        fraction of the values clipped: |code| at the format's largest magnitude (6 for E2M1, 448 / 57344
                   for E4M3 / E5M2) in a block of nonzero scale, and |x| > |x̂|
  flushed          fraction of the nonzero values that quantize to zero
  scale_underflow  fraction of the blocks holding a nonzero value whose decoded block scale is below the scale
                   format's smallest normal (E4M3: 2^-6, zero included; E8M0: its smallest value 2^-127), so the
                   block loses resolution or is flushed whole
  scale_overflow   fraction of the blocks whose block scale is the scale format's largest finite value (E4M3 448,
                   E8M0 2^127) and that hold a saturated value: the block needed a larger scale than exists (0 for
                   finite inputs of these formats: tensor-scaled NVFP4 block scales stay <= 448 by construction, and
                   E8M0 covers float32's range; kept for scale formats and inputs where it can happen)
  amax             max |x|
RHT operands (NVFP4 with ``rht``, the wgrad pair) are compared in the transformed domain (the values that are
quantized: `jax_fp4.reference.rht.forward` of x along the block axis, and x̂ without the inverse transform); the SNR
is the same in either domain (the transform is orthogonal) up to the bfloat16 rounding of the transform.

`OPERANDS` names the six GEMM operands of a dense layer y = x @ w in the orientation each GEMM reads (the fields of
`jax_fp4.recipes.Recipe`): fprop_x (x, blocks along K), fprop_w (w, along K), dgrad_dy (dy, along N), dgrad_w (w,
along N), wgrad_x (x, along M), wgrad_dy (dy, along M). An operand the recipe leaves unquantized gets snr +inf,
fractions 0 and its amax.

Inside a jitted training step (no host synchronisation): `dense(x, kernel, bias, recipe=..., key=..., probe=p)`
computes `jax_fp4.dense` and records the statistics of all six operands into the *gradient* of the zero-valued
probe p (float32 [6, 6]): x's and w's from the forward, dy's in the backward (a custom-VJP identity on the output
sees exactly the dy the dense backward receives). Differentiate the loss with respect to the probes too and read
the statistics from their gradients; `jax_fp4.flax.diagnostics` does that for NNX models. The keys are derived as
`jax_fp4.dense` derives them, so stochastic rounding draws the same bits the GEMMs see.

The module computes statistics only; writing them out (CSV files, heatmaps) is left to the caller
(examples/lm/lm_report.py writes train_lm's diagnostics.csv and heatmap PNGs).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from jax_fp4._src.primitives.dequantize import dequantize_array
from jax_fp4._src.vjp_util import operand_keys
from jax_fp4.dense import dense as _dense
from jax_fp4.formats import MXFP8, NVFP4
from jax_fp4.quantize import dequantize, quantize, quantize_rowwise_columnwise
from jax_fp4.quantized_array import QuantizedArray
from jax_fp4.recipes import Recipe, resolve
from jax_fp4.reference import rht

__all__ = ["STATS", "OPERANDS", "quantization_stats", "operand_stats", "unquantized_stats", "dense", "dense_stats",
           "probe_shape"]

STATS = ("snr_db", "saturated", "flushed", "scale_underflow", "scale_overflow", "amax")
OPERANDS = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_x", "wgrad_dy")
_E4M3_MIN_NORMAL = 2.0 ** -6


def _scale_limits(fmt):
    """(underflow bound, largest finite) of the decoded block scale: a scale below the bound underflows (E4M3: its
    smallest normal 2^-6; E8M0, powers of two: 2^-126, i.e. the clamp value 2^-127)."""
    if isinstance(fmt, NVFP4):
        return _E4M3_MIN_NORMAL, fmt.scale_max
    return 2.0 ** -126, 2.0 ** 127


def _to_x_layout(a, q: QuantizedArray):
    """A data-layout array of q (NVFP4: block axis last) in the logical (x's) layout."""
    if q.fmt.stores_block_axis_last:
        return jnp.moveaxis(a, -1, q.axis)
    return a


def _block_view(a, axis, bs):
    """a [..., n, ...] with the block axis split: [..., n / bs, bs, ...] (block index at `axis`)."""
    axis = axis % a.ndim
    return a.reshape(*a.shape[:axis], a.shape[axis] // bs, bs, *a.shape[axis + 1:]), axis + 1


def unquantized_stats(x) -> jax.Array:
    """float32[6] of an operand that is not quantized: snr +inf, the fractions 0, its amax."""
    amax = jnp.max(jnp.abs(jnp.asarray(x).astype(jnp.float32))) if jnp.size(x) else jnp.float32(0)
    return jnp.stack([jnp.float32(jnp.inf), *(jnp.float32(0),) * 4, amax.astype(jnp.float32)])


def quantization_stats(x, q: QuantizedArray) -> jax.Array:
    """float32[6] (`STATS`) of x against its quantization q (any orientation; compact or swizzled scales).

    Args:
      x: the array q quantizes (bfloat16 / float16 / float32, q.shape).
      q: `jax_fp4.quantize(x, fmt, axis=...)` or an orientation of `quantize_rowwise_columnwise` (x viewed as x2).

    Raises:
      ValueError: x's size differs from q's shape's, or q is not a QuantizedArray.
    """
    if not isinstance(q, QuantizedArray):
        raise ValueError(f"quantization_stats: q must be a jax_fp4.QuantizedArray, got {type(q).__name__}")
    x = jnp.asarray(x)
    if x.size != math.prod(q.shape):
        raise ValueError(f"quantization_stats: x {x.dtype}{list(x.shape)} is not the array of {q!r}")
    from jax_fp4.quantize import unswizzle_scales

    q = unswizzle_scales(q)
    fmt = q.fmt
    x = x.reshape(q.shape).astype(jnp.float32)
    rht_on = fmt.rht
    if rht_on:  # compare where the quantization happens: the transformed values (block axis last, then back)
        xd = jnp.moveaxis(rht.forward(jnp.moveaxis(x, q.axis, -1)), -1, q.axis)
        xhat = dequantize_array(q, jnp.float32, inverse_rht=False)
    else:
        xd, xhat = x, dequantize(q, jnp.float32)
    err = x - dequantize(q, jnp.float32) if rht_on else xd - xhat
    signal, noise = jnp.sum(x * x), jnp.sum(err * err)
    snr = jnp.where(noise > 0, 10.0 * jnp.log10(signal / jnp.where(noise > 0, noise, 1.0)),
                    jnp.where(signal > 0, jnp.inf, jnp.nan))
    codes = _to_x_layout(q.data.astype(jnp.float32), q)
    scale = _to_x_layout(q.scale.astype(jnp.float32), q)
    bs = fmt.block_size
    scale_full = jnp.repeat(scale, bs, axis=q.axis)
    sat = (jnp.abs(codes) == fmt.max_value) & (scale_full > 0) & (jnp.abs(xd) > jnp.abs(xhat))
    nonzero = xd != 0
    flushed = nonzero & (xhat == 0)
    n = max(x.size, 1)
    blocks_nz, bax = _block_view(nonzero, q.axis, bs)
    blocks_sat, _ = _block_view(sat, q.axis, bs)
    any_nz, any_sat = jnp.any(blocks_nz, axis=bax), jnp.any(blocks_sat, axis=bax)
    lo, hi = _scale_limits(fmt)
    nblocks = max(scale.size, 1)
    under = jnp.sum(any_nz & (scale < lo)) / nblocks
    over = jnp.sum(any_sat & (scale >= hi)) / nblocks
    amax = jnp.max(jnp.abs(x)) if x.size else jnp.float32(0)
    return jnp.stack([snr, jnp.sum(sat) / n, jnp.sum(flushed) / jnp.maximum(jnp.sum(nonzero), 1), under, over,
                      amax]).astype(jnp.float32)


def operand_stats(x, fmt, *, axis: int = -1, key=None) -> jax.Array:
    """float32[6] (`STATS`) of x quantized to `fmt` (NVFP4 / MXFP8 spec, or None: unquantized) along `axis`.

    Raises:
      ValueError: as `jax_fp4.quantize` (shape not a multiple of the block, missing key for stochastic rounding).
    """
    if fmt is None:
        return unquantized_stats(x)
    if not isinstance(fmt, (NVFP4, MXFP8)):
        raise ValueError(f"operand_stats: fmt must be an NVFP4 or MXFP8 spec or None, got {fmt!r}")
    return quantization_stats(x, quantize(x, fmt, axis=axis, key=key))


def _pair_stats(a2, row_fmt, col_fmt, key):
    """(stats of the rowwise, of the columnwise quantization) of a2 [M, K], quantized as jax_fp4.dense does."""
    if row_fmt is None and col_fmt is None:
        s = unquantized_stats(a2)
        return s, s
    row, col, _ = quantize_rowwise_columnwise(a2, row_fmt, col_fmt, key=key)
    return (unquantized_stats(a2) if row is None else quantization_stats(a2, row),
            unquantized_stats(a2) if col is None else quantization_stats(a2, col))


def probe_shape() -> tuple[int, int]:
    """The shape of a dense layer's statistics: (len(OPERANDS), len(STATS))."""
    return len(OPERANDS), len(STATS)


def _forward_stats(x2, kernel, recipe: Recipe, kx, kw):
    fx, wx = _pair_stats(x2, recipe.fprop_x, recipe.wgrad_x, kx)
    dw, fw = _pair_stats(kernel, recipe.dgrad_w, recipe.fprop_w, kw)
    nan = jnp.full((len(STATS),), jnp.nan, jnp.float32)
    return jnp.stack([fx, fw, nan, dw, wx, nan])  # the dy rows are filled in the backward


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _record(recipe, y, probe, fwd_stats, kdy):
    return y


def _record_fwd(recipe, y, probe, fwd_stats, kdy):
    return y, (fwd_stats, kdy)


def _record_bwd(recipe, res, dy):
    fwd_stats, kdy = res
    dgrad, wgrad = _pair_stats(dy.reshape(-1, dy.shape[-1]), recipe.dgrad_dy, recipe.wgrad_dy, kdy)
    stats = fwd_stats.at[2].set(dgrad).at[5].set(wgrad)
    return dy, stats, jnp.zeros_like(fwd_stats), None


_record.defvjp(_record_fwd, _record_bwd)


def dense_stats(x, kernel, *, recipe: Recipe, key=None) -> jax.Array:
    """float32[6, 6] of the forward operands of `jax_fp4.dense(x, kernel, recipe=recipe, key=key)` (rows `OPERANDS`,
    columns `STATS`); the dy rows (dgrad_dy, wgrad_dy) are NaN (dy exists in the backward only: see `dense`).
    `recipe`: a Recipe or its name."""
    recipe = resolve(recipe, "diagnostics.dense_stats")
    x = jnp.asarray(x)
    return _forward_stats(x.reshape(-1, x.shape[-1]), jnp.asarray(kernel), recipe, *operand_keys(key)[:2])


def dense(x, kernel, bias=None, *, recipe: Recipe, key=None, probe):
    """`jax_fp4.dense(x, kernel, bias, recipe=recipe, key=key)` that records the statistics of its six GEMM operands
    into the gradient of `probe`.

    Args:
      x, kernel, bias, recipe, key: as `jax_fp4.dense` (same result, same gradients, same quantization bits).
      probe: float32 [6, 6] (`probe_shape()`), any value (zeros): its cotangent becomes the statistics
        (rows `OPERANDS`, columns `STATS`) when the output's gradient is taken.

    Returns:
      y, as `jax_fp4.dense`.
    """
    recipe = resolve(recipe, "diagnostics.dense")
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    y = _dense(x, kernel, bias, recipe=recipe, key=key)
    if jnp.shape(probe) != probe_shape():
        raise ValueError(f"diagnostics.dense: probe must have shape {probe_shape()}, got {jnp.shape(probe)}")
    kx, kw, kdy = operand_keys(key)  # as jax_fp4.dense splits it
    x2 = jax.lax.stop_gradient(x.reshape(-1, x.shape[-1]))
    fwd = _forward_stats(x2, jax.lax.stop_gradient(kernel), recipe, kx, kw)
    return _record(recipe, y, probe, fwd, kdy)
