"""The reference's entry points: orientation + format dispatch over `nvfp4` and `mxfp8`."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from jax_fp4.formats import MXFP8, NVFP4, Format
from jax_fp4.reference import codes, layout, mxfp8, nvfp4
from jax_fp4.validation import check_quantize_inputs as check_inputs


class Quantized(NamedTuple):
    """Raw quantize outputs (compact scales).

    NVFP4: data float4_e2m1fn [block axis last], scale float8_e4m3fn [..., n/16], amax float32 [] (None for 1x64),
    window_amax float32 [..., n/64] (1x64 only). MXFP8: data float8_e4m3fn/e5m2 with x's shape, scale
    float8_e8m0fnu with x's shape and the block axis / 32, amax and window_amax None.
    """

    data: jnp.ndarray
    scale: jnp.ndarray
    amax: jnp.ndarray | None
    window_amax: jnp.ndarray | None


def quantize(x, fmt: Format, *, axis: int = -1, key=None) -> Quantized:
    """Quantize x along the block `axis` to `fmt` (compact scales). See `jax_fp4.quantize` for the contract."""
    axis = check_inputs(x, fmt, axis, key)
    x = jnp.asarray(x)
    y = jnp.moveaxis(x, axis, -1)
    if isinstance(fmt, NVFP4):
        p = nvfp4.quantize(y, fmt, key)
        amax = p.amax
        if amax is not None and x.size:  # NaN stays visible (docs/numerics.md s6): the encode above
            amax = jnp.where(jnp.any(jnp.isnan(x)), jnp.float32(jnp.nan), amax)  # used the finite amax
        wamax = p.window_amax
        if wamax is not None:  # likewise per 1x64 window
            wamax = jnp.where(nvfp4.window_nan(y, -1), jnp.float32(jnp.nan), wamax)
        return Quantized(
            codes.to_dtype(p.codes, fmt.data_dtype), codes.to_dtype(p.scale_codes, fmt.scale_dtype), amax, wamax,
        )
    q, e = mxfp8.quantize(y, fmt)
    data = jnp.moveaxis(codes.to_dtype(q, fmt.data_dtype), -1, axis)
    scale = jnp.moveaxis(codes.to_dtype(e, fmt.scale_dtype), -1, axis)
    return Quantized(data, scale, None, None)


def dequantize(data, scale, amax, window_amax, fmt: Format, axis: int, dtype=jnp.float32):
    """Inverse of `quantize` (compact scales): returns `dtype` values with the original x's shape."""
    if isinstance(fmt, NVFP4):
        v = nvfp4.dequantize(codes.from_dtype(data), codes.from_dtype(scale), amax, window_amax, fmt)
        return codes.output(jnp.moveaxis(v, -1, axis), dtype)
    if isinstance(fmt, MXFP8):
        v = mxfp8.dequantize(jnp.moveaxis(data, axis, -1), codes.from_dtype(jnp.moveaxis(scale, axis, -1)), fmt,
                             dtype)
        return codes.output(jnp.moveaxis(v, -1, axis), dtype)
    raise ValueError(f"dequantize: unknown format {fmt!r}")


def swizzle_scales(scale, fmt: Format, axis: int):
    """Compact scales -> padded GEMM-swizzled 2-D scales (MXFP8 columnwise transposed first)."""
    return layout.swizzle(layout.scale_matrix(scale, axis, fmt.stores_block_axis_last))


def unswizzle_scales(sw, fmt: Format, scale_shape, axis: int):
    """Padded GEMM-swizzled 2-D scales -> compact scales of `scale_shape`."""
    moved = scale_shape if fmt.stores_block_axis_last else jnp.moveaxis(jnp.empty(scale_shape, bool), axis, -1).shape
    rows = 1
    for d in moved[:-1]:
        rows *= d
    m = layout.unswizzle(sw, rows, moved[-1])
    return layout.from_scale_matrix(m, scale_shape, axis, fmt.stores_block_axis_last)
