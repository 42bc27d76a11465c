"""The memory-traffic floor of a quantized Dense step (the model behind `benchmarks/dense.py`'s floor column).

On a GPU without a block-scaled GEMM the layer computes every quantized GEMM as a bf16 GEMM over exact operands
(value x block scale in bfloat16, written by the quantize pass itself) and keeps the backward's operands as packed
residuals. Beyond the GEMMs (which the bf16 step runs too) such a step must move, per GEMM operand role:

  fprop   x [M, K]: one read of x (2 B/element) for both orientations; the exact fprop operand written (2 B); the
          wgrad residual written (codes + block scales + amax, as `jax_fp4.quantize` returns them).
          w [K, N]: the same (exact fprop operand, dgrad residual), plus one read of w for its tensor amax when an
          orientation of w has a plain tensor scale (a weight has no producer to compute it).
  dgrad   dY [M, N]: one read; both exact operands written (dgrad rowwise, wgrad columnwise).
          w residual: read, exact dgrad operand written (the dequantize pass).
  wgrad   x residual: read, exact wgrad operand written.
  RHT orientations add one read of their input (the transform's amax pass); an unquantized orientation moves nothing.

The tensor amax of an activation (x) and of a gradient (dY) is taken as free: a producer can compute it in its own
fusion (`jax_fp4.dense(..., x_amax=)`), so it is not part of the floor. Floor time = bytes / the copy bandwidth
(read + write) measured in the same run; the step's target is the bf16 step plus that time.

Not a floor for routes that consume packed codes (the `jf4_gemm` kernel, a native block-scaled GEMM): the rows
those routes run are labelled by their route in dense.py.
"""

from __future__ import annotations

import _common as bench  # benchmarks/_common.py: the importer puts benchmarks/ on sys.path
import jax
import jax.numpy as jnp

import jax_fp4
from jax_fp4.recipes import Recipe

BF16 = 2  # bytes per element of the layer's inputs and of an exact operand


def _codes(shape, fmt, axis) -> int:
    """Bytes of a stored quantization (codes, block scales, tensor / window amax) of a bf16 array."""
    if fmt is None:
        return 0
    q = jax.eval_shape(lambda a: jax_fp4.quantize(a, fmt, axis=axis), jax.ShapeDtypeStruct(shape, jnp.bfloat16))
    return bench.tree_bytes(q)


def _rht_reads(elements: int, *fmts) -> int:
    return sum(BF16 * elements for f in fmts if f is not None and getattr(f, "rht", False))


def floor_bytes(recipe: Recipe, m: int, k: int, n: int) -> dict:
    """{"fprop", "dgrad", "wgrad", "total"}: bytes the quantize / amax / dequantize passes of one exact-operand
    Dense step must move (module docstring), x [m, k], w [k, n], dY [m, n], bf16 inputs."""
    r = recipe
    mk, kn, mn = m * k, k * n, m * n
    out = {"fprop": 0, "dgrad": 0, "wgrad": 0}
    if r.fprop_x is not None or r.wgrad_x is not None:
        out["fprop"] += BF16 * mk + (BF16 * mk if r.fprop_x is not None else 0) + _codes((m, k), r.wgrad_x, 0)
        out["fprop"] += _rht_reads(mk, r.fprop_x, r.wgrad_x)
    if r.fprop_w is not None or r.dgrad_w is not None:
        out["fprop"] += BF16 * kn + (BF16 * kn if r.fprop_w is not None else 0) + _codes((k, n), r.dgrad_w, 1)
        plain = [f for f in (r.fprop_w, r.dgrad_w) if f is not None and f.has_tensor_amax and not f.rht]
        out["fprop"] += BF16 * kn if plain else 0
        out["fprop"] += _rht_reads(kn, r.fprop_w, r.dgrad_w)
    if r.dgrad_dy is not None or r.wgrad_dy is not None:
        out["dgrad"] += BF16 * mn + sum(BF16 * mn for f in (r.dgrad_dy, r.wgrad_dy) if f is not None)
        out["dgrad"] += _rht_reads(mn, r.dgrad_dy, r.wgrad_dy)
    if r.dgrad_w is not None:
        out["dgrad"] += _codes((k, n), r.dgrad_w, 1) + BF16 * kn
    if r.wgrad_x is not None:
        out["wgrad"] += _codes((m, k), r.wgrad_x, 0) + BF16 * mk
    out["total"] = sum(out.values())
    return out
