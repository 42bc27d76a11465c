"""Public grouped (MoE) quantize / dequantize: N tensors in contiguous buffers with device-resident group sizes.

`grouped_quantize` and `grouped_quantize_rowwise_columnwise` bind `jf4_grouped_quantize`
(jax_fp4/_src/primitives/grouped.py), `grouped_dequantize` binds `jf4_grouped_dequantize`. Group sizes are arrays
(a router's counts, traced under jit): nothing copies them to the host. docs/numerics.md section 4; the bit-exact
reference is `jax_fp4.reference.grouped`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp4 import validation
from jax_fp4._src.primitives.grouped import grouped_dequantize_raw, grouped_quantize_raw
from jax_fp4.formats import Format
from jax_fp4.grouped_array import GroupedQuantizedArray
from jax_fp4.reference import grouped as ref

__all__ = ["grouped_quantize", "grouped_quantize_rowwise_columnwise", "grouped_dequantize"]


def _dims(group_sizes, last_dims, where):
    """Keyword arguments of `jax_fp4.validation.validate` picking the representation."""
    if isinstance(group_sizes, (int, np.integer)) and not isinstance(group_sizes, (bool, np.bool_)):
        if last_dims is not None:
            raise ValueError(f"{where}: an int group_sizes ({group_sizes}) means SAME_BOTH_DIMS, which takes no "
                             f"last_dims")
        return dict(num_groups=int(group_sizes))
    if group_sizes is None and last_dims is None:
        raise ValueError(f"{where}: give group_sizes (an int N, or int[N] first dims) and / or last_dims")
    return dict(first_dims=group_sizes, last_dims=last_dims)


def _needs_key(fmt) -> bool:
    return isinstance(fmt, Format) and fmt.needs_key


def _array(o, prefix, fmt, axis, rep, rows, cols, x):
    amax = None
    if fmt.has_tensor_amax:  # NaN stays visible per group (reference.grouped.group_has_nan): one extra pass over x
        amax = jnp.where(ref.group_has_nan(x, rows, cols), jnp.float32(jnp.nan), o[f"{prefix}_amax"])
    return GroupedQuantizedArray(o[f"{prefix}_data"], o[f"{prefix}_scale"], amax, rows, cols,
                                 ref.group_offsets(rows, cols), fmt=fmt, axis=axis, representation=rep,
                                 shape=tuple(x.shape))


def _given_amax(amax, fmt, n, where, side):
    """float32[N] of a given per-group amax (None stays None); ValueError for non-NVFP4 formats or a bad shape."""
    if amax is None:
        return None
    if fmt is None or not fmt.has_tensor_amax:
        raise ValueError(f"{where}: a given {side} amax needs an NVFP4 format (it sets the tensor scale), got {fmt!r}")
    a = jnp.asarray(amax)
    if a.shape != (n,) or not jnp.issubdtype(a.dtype, jnp.floating):
        raise ValueError(f"{where}: {side} amax must be a float array of shape ({n},) (one per group), got "
                         f"{a.dtype}{list(a.shape)}")
    return a.astype(jnp.float32)


def grouped_quantize(x, group_sizes, fmt: Format, *, last_dims=None, axis: int = -1, key=None, amax=None
                     ) -> GroupedQuantizedArray:
    """Quantize the N groups of x to `fmt`, each with its own tensor scale, in one call.

    Args:
      x: bfloat16 / float16 / float32 buffer of the groups (see `GroupedQuantizedArray` for the layouts).
      group_sizes: picks the representation with `last_dims`:
        * an int N: SAME_BOTH_DIMS, x [N*M, K] holds N groups [M, K];
        * int[N] (any int dtype, traced or not): the first dims M_g, VARYING_FIRST_DIM with x [T, K] (T >= sum
          M_g; the MoE tokens sorted by expert, group_sizes = tokens per expert), or VARYING_BOTH_DIMS with a 1-D
          x when `last_dims` is given too;
        * None with last_dims: VARYING_LAST_DIM, x [M, C] holds groups [M, K_g] one after the other.
      fmt: NVFP4 1D (optionally rht / stochastic_rounding) or MXFP8 (e4m3 / e5m2).
      last_dims: int[N] group last dims K_g (VARYING_LAST_DIM / VARYING_BOTH_DIMS), else None.
      axis: -1 rowwise (blocks along each group's K_g), 0 columnwise (along each M_g; NVFP4 stores x_g.T).
      key: PRNG key, required for stochastic rounding; group g uses `jax.random.fold_in(key, g)`.
      amax: NVFP4 only: float[N] per-group tensor amaxes to encode with (|x_g| max, after the RHT for RHT formats;
        e.g. from an amax history or an earlier call's `.amax`), which skips the amax pass (a second read of x);
        None computes each group's own.

    Returns:
      GroupedQuantizedArray: group g equals `jax_fp4.quantize(x_g, fmt, axis=axis, key=fold_in(key, g))` bit for
      bit (data, scales, amax), or with a given amax the NVFP4 encode of x_g with tensor amax amax[g]
      (`reference.nvfp4.quantize_with_amax`); empty groups are legal; buffer positions past the last group hold code
      0.

    Raises:
      ValueError (trace time): dtype not bfloat16/float16/float32; a rank that does not fit the representation; a
      given amax with an MXFP8 format or of a shape other than (N,);
      NVFP4 scaling_2d / local_1x64 (single-tensor formats); stochastic rounding without a key; an unknown axis;
      a static block-axis dimension (K rowwise for SAME_BOTH_DIMS / VARYING_FIRST_DIM, M columnwise for
      SAME_BOTH_DIMS / VARYING_LAST_DIM) not a multiple of the block size (16 NVFP4, 32 MXFP8); concrete (non-traced)
      sizes that are negative, misaligned along the block axis, or overrun x.

    Alignment of traced sizes: the block-axis length of every group (M_g for columnwise VARYING_FIRST_DIM, the
    wgrad operand of an MoE layer) must be a multiple of the block size; the caller pads the groups (as Megatron's
    router padding for FP8 does; `jax_fp4.flax.moe` pads to the recipe's block). A misaligned traced group cannot
    raise; it is poisoned on the device (NaN scales, NaN amax / MXFP8 data), so it shows as NaN downstream.
    """
    x, rep, n, rows, cols, axis = validation.validate(x, fmt, **_dims(group_sizes, last_dims, "grouped_quantize"),
                                               axis=axis, key=key)
    words = ref.group_key_words(key, n) if _needs_key(fmt) else None
    row = axis == -1
    given = _given_amax(amax, fmt, n, "grouped_quantize", "rowwise" if row else "columnwise")
    o = grouped_quantize_raw(x, rows, cols, words if row else None, None if row else words,
                             row_fmt=fmt if row else None, col_fmt=None if row else fmt, representation=rep,
                             row_amax=given if row else None, col_amax=None if row else given)
    return _array(o, "row" if row else "col", fmt, axis, rep, rows, cols, x)


def grouped_quantize_rowwise_columnwise(x, group_sizes, row_fmt: Format | None, col_fmt: Format | None, *,
                                        last_dims=None, key=None, dbias: bool = False, row_amax=None,
                                        col_amax=None):
    """Rowwise and columnwise grouped quantizations of x from one call (the grouped GEMM operands of fprop and
    wgrad), optionally with the grouped bias gradient.

    Args:
      x, group_sizes, last_dims: as `grouped_quantize`.
      row_fmt, col_fmt: formats of the rowwise / columnwise quantizations, or None (not both); any pairing.
      key: PRNG key for stochastic rounding; the rowwise and columnwise streams use `jax.random.split(key)[0]` and
        `[1]`, each folded with the group index.
      dbias: also return the per-group column sums of x in float32 (the bias gradient of grouped dY): [N, K] for
        SAME_BOTH_DIMS / VARYING_FIRST_DIM, [C] for VARYING_LAST_DIM (group g's at sum(K_<g)); VARYING_BOTH_DIMS
        raises. An fp32 sum in an unspecified order (not bit-exact).
      row_amax, col_amax: as `grouped_quantize`'s amax, per orientation (NVFP4 only); None computes them.

    Returns:
      (row, col, dbias): row == grouped_quantize(x, ..., row_fmt, axis=-1, key=k0) and col == grouped_quantize(x,
      ..., col_fmt, axis=0, key=k1) bit for bit (None where the format is None); dbias float32 or None.

    Raises:
      ValueError as `grouped_quantize` for each orientation (a given amax included); both formats None; dbias with
      VARYING_BOTH_DIMS.
    """
    if row_fmt is None and col_fmt is None:
        raise ValueError(f"grouped_quantize_rowwise_columnwise: both formats are None (x {jnp.shape(x)})")
    dims = _dims(group_sizes, last_dims, "grouped_quantize_rowwise_columnwise")
    need = any(_needs_key(f) for f in (row_fmt, col_fmt))
    keys = jax.random.split(key) if (need and key is not None) else (None, None)
    checked = None
    for fmt, axis, k in ((row_fmt, -1, keys[0]), (col_fmt, 0, keys[1])):
        if fmt is not None:
            checked = validation.validate(x, fmt, **dims, axis=axis, key=k)
    x, rep, n, rows, cols, _ = checked
    words = [ref.group_key_words(k, n) if _needs_key(f) else None
             for f, k in zip((row_fmt, col_fmt), keys, strict=True)]
    where = "grouped_quantize_rowwise_columnwise"
    o = grouped_quantize_raw(x, rows, cols, *words, row_fmt=row_fmt, col_fmt=col_fmt, representation=rep,
                             dbias=dbias, row_amax=_given_amax(row_amax, row_fmt, n, where, "rowwise"),
                             col_amax=_given_amax(col_amax, col_fmt, n, where, "columnwise"))
    row = None if row_fmt is None else _array(o, "row", row_fmt, -1, rep, rows, cols, x)
    col = None if col_fmt is None else _array(o, "col", col_fmt, 0, rep, rows, cols, x)
    return row, col, (o["dbias"] if dbias else None)


def grouped_dequantize(gq: GroupedQuantizedArray, dtype=jnp.float32, *, raw: bool = False) -> jax.Array:
    """Dequantize every group of `gq` into `dtype` (float32 / bfloat16 / float16) values of gq.shape.

    Group g equals `jax_fp4.dequantize` of its single-tensor quantization bit for bit (NVFP4 value(q) * ((s_b * amax)
    * fp32(1/2688)), then the inverse RHT; MXFP8 float(q) * 2**(e - 127); rounded once to `dtype`); positions outside
    every group are 0; a poisoned (misaligned) group is NaN.

    raw=True: the block-scaled values without the NVFP4 tensor scale and without the inverse RHT (value(q) * s_b,
    exact in float32): the operand of the GEMM emulation (`jax_fp4.ragged_dot`), whose tensor scales amax/2688 are
    applied to the float32 product.

    Raises:
      ValueError: `gq` is not a GroupedQuantizedArray, or `dtype` is not float32/bfloat16/float16.
    """
    if not isinstance(gq, GroupedQuantizedArray):
        raise ValueError(f"grouped_dequantize expects a jax_fp4.GroupedQuantizedArray, got {type(gq).__name__}")
    return grouped_dequantize_raw(gq.data, gq.scale, gq.amax, gq.first_dims, gq.last_dims, fmt=gq.fmt,
                                  axis=gq.axis, x_shape=gq.shape, out_dtype=dtype, raw=raw)
