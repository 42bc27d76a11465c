"""Quantized `dense` and `dot_general` with a custom VJP following a `Recipe` (jax_fp4.recipes).

Forward: x is quantized once (rowwise for fprop, columnwise for wgrad: one kernel launch, e.g. the mixed NVFP4-row /
MXFP8-column pass), the weight once (columnwise for fprop, rowwise for dgrad), and y = x @ w runs as a
`scaled_dot_general`. The residuals are the *quantized* wgrad x and dgrad w (not bfloat16 copies), tagged with
`jax.ad_checkpoint.checkpoint_name` ("jax_fp4_x_wgrad", "jax_fp4_w_dgrad") for remat policies.
Backward: dy is quantized once for both GEMMs (rowwise for dgrad, columnwise for wgrad) with the bias gradient fused
into the same pass; dx = dy @ w.T and dw = x.T @ dy.
Randomness (stochastic rounding): `key` is split into (x, w, dy) keys with `jax.random.split(key, 3)`.
Emulated GEMMs (CPU, Hopper: no native block-scaled GEMM): an operand consumed at once (not a residual) comes from
the quantize pass as an `ExactOperand` (bfloat16 value(q) * block scale, written by the same kernel launch), so no
dequantize pass runs for it: fprop's x and w, and both dy operands. The residuals stay quantized. The bits of every
product are those of `scaled_dot_general` on the QuantizedArrays.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jax_fp4._src.vjp_util import dtype_tag, operand_keys
from jax_fp4.formats import NVFP4
from jax_fp4.gemm import ExactOperand, exact_dot_general, native_gemm_available, scaled_dot_general
from jax_fp4.quantize import quantize_rowwise_columnwise
from jax_fp4.recipes import Recipe

__all__ = ["dense", "dot_general", "RESIDUAL_NAMES"]

RESIDUAL_NAMES = ("jax_fp4_x_wgrad", "jax_fp4_w_dgrad")
_FPROP = (((1,), (0,)), ((), ()))  # x[M, K] . w[K, N]
_DGRAD = (((1,), (1,)), ((), ()))  # dy[M, N] . w[K, N] over N
_WGRAD = (((0,), (0,)), ((), ()))  # x[M, K] . dy[M, N] over M


def _exact_ok(fmt, wanted) -> bool:
    """Whether an orientation is returned as an ExactOperand: wanted (consumed at once by an emulated GEMM) and a
    format whose block scales factor out of the product (not 1x64, not unquantized)."""
    return wanted and fmt is not None and not (isinstance(fmt, NVFP4) and fmt.local_1x64)


def _quantize_pair(a, row_fmt, col_fmt, key, dbias=False, exact=(False, False)):
    """(rowwise, columnwise, dbias) of a 2-D a; an unquantized orientation is `a` itself."""
    if row_fmt is None and col_fmt is None:
        db = jnp.sum(a.astype(jnp.float32), axis=0) if dbias else None
        return a, a, db
    ex = (_exact_ok(row_fmt, exact[0]), _exact_ok(col_fmt, exact[1]))
    row, col, db = quantize_rowwise_columnwise(a, row_fmt, col_fmt, key=key, dbias=dbias, exact=ex)
    return (a if row is None else row), (a if col is None else col), db


def _gemm(a, b, dn):
    if isinstance(a, ExactOperand) or isinstance(b, ExactOperand):
        return exact_dot_general(a, b, dn, jnp.float32)
    if hasattr(a, "fmt"):
        return scaled_dot_general(a, b, dn, jnp.float32)
    return lax.dot_general(a, b, dn, preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dense(recipe, x2, w, bias, key):
    return _dense_fwd(recipe, x2, w, bias, key)[0]


def _dense_fwd(recipe, x2, w, bias, key):
    kx, kw, kdy = operand_keys(key)
    emulated = not native_gemm_available()
    x_fprop, x_wgrad, _ = _quantize_pair(x2, recipe.fprop_x, recipe.wgrad_x, kx, exact=(emulated, False))
    w_dgrad, w_fprop, _ = _quantize_pair(w, recipe.dgrad_w, recipe.fprop_w, kw, exact=(False, emulated))
    y = _gemm(x_fprop, w_fprop, _FPROP)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    res = (jax.tree.map(partial(checkpoint_name, name=RESIDUAL_NAMES[0]), x_wgrad),
           jax.tree.map(partial(checkpoint_name, name=RESIDUAL_NAMES[1]), w_dgrad),
           kdy, dtype_tag(x2), dtype_tag(w), None if bias is None else dtype_tag(bias))
    return y.astype(jnp.result_type(x2, w)), res


def _dense_bwd(recipe, res, dy):
    x_wgrad, w_dgrad, kdy, xs, ws, bs = res
    has_bias = bs is not None
    emulated = not native_gemm_available()
    dy_dgrad, dy_wgrad, db = _quantize_pair(dy, recipe.dgrad_dy, recipe.wgrad_dy, kdy, dbias=has_bias,
                                            exact=(emulated, emulated))
    dx = _gemm(dy_dgrad, w_dgrad, _DGRAD).astype(xs.dtype)
    dw = _gemm(x_wgrad, dy_wgrad, _WGRAD).astype(ws.dtype)
    dbias = db.astype(bs.dtype) if has_bias else None
    return dx, dw, dbias, None


_dense.defvjp(_dense_fwd, _dense_bwd)


def dense(x, kernel, bias=None, *, recipe: Recipe, key=None):
    """y = x @ kernel + bias with the GEMMs quantized as `recipe` says (custom VJP, see the module docstring).

    Args:
      x: bfloat16/float16/float32 [..., K]; the tokens M = prod(x.shape[:-1]).
      kernel: [K, N] (same float dtypes).
      bias: [N] or None.
      recipe: a `jax_fp4.recipes.Recipe` (BF16 runs plain `lax.dot_general`, exactly like flax's Linear).
      key: PRNG key, required when the recipe uses stochastic rounding.

    Returns:
      [..., N] in the promoted dtype of x and kernel, as `lax.dot_general` gives (the quantized GEMMs accumulate in
      float32 and add the bias in float32 before the one cast; BF16 adds it after, as flax's Linear does).

    Raises:
      ValueError: shapes that do not line up, a missing key, or shapes the recipe's formats cannot block (e.g.
      MXFP8 wgrad needs M % 32 == 0, NVFP4 needs K and N % 16 == 0; the message names the shape and format).
    """
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    if kernel.ndim != 2 or x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
        raise ValueError(f"dense: x {x.dtype}{list(x.shape)} and kernel {kernel.dtype}{list(kernel.shape)} do not "
                         "line up (x [..., K], kernel [K, N])")
    if bias is not None and jnp.shape(bias) != (kernel.shape[1],):
        raise ValueError(f"dense: bias shape {jnp.shape(bias)} != ({kernel.shape[1]},)")
    if not recipe.quantized:
        y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        if bias is not None:
            y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y
    if recipe.needs_key and key is None:
        raise ValueError(f"dense: recipe {recipe.name} uses stochastic rounding and needs key=...")
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), x.shape[-1])
    y = _dense(recipe, x2, kernel, bias, key)
    return y.reshape(*lead, kernel.shape[1])


def dot_general(x, w, dimension_numbers, *, recipe: Recipe, key=None):
    """`lax.dot_general(x, w, dimension_numbers)` with the GEMMs quantized as `recipe` says (custom VJP).

    Supported: x contracting its last axis with w's first axis and no batch axes (w may have several output axes:
    [K, N1, N2, ...]), the form of every dense / projection layer. Other dimension numbers raise ValueError.
    """
    (cx, cw), (bx, bw) = dimension_numbers
    x, w = jnp.asarray(x), jnp.asarray(w)
    if bx or bw or tuple(cx) not in ((x.ndim - 1,), (-1,)) or tuple(cw) != (0,):
        raise ValueError(f"dot_general: only x[..., K] . w[K, ...] (contracting x's last and w's first axis, no "
                         f"batch axes) is supported, got {dimension_numbers} for {x.shape} . {w.shape}")
    out = w.shape[1:]
    y = dense(x, w.reshape(w.shape[0], math.prod(out)), recipe=recipe, key=key)
    return y.reshape(*x.shape[:-1], *out)
