"""Public quantize / dequantize (ops layer). Kernels are swapped in behind these signatures by later issues;
today every path runs the bit-exact reference (`jax_fp4.reference`), which XLA compiles for CPU and GPU alike."""

from __future__ import annotations

import jax.numpy as jnp

from jax_fp4 import reference
from jax_fp4.formats import Format
from jax_fp4.quantized_array import SCALE_LAYOUTS, QuantizedArray

__all__ = ["quantize", "dequantize", "swizzle_scales", "unswizzle_scales"]


def quantize(x, fmt: Format, *, axis: int = -1, key=None, scale_layout: str = "compact") -> QuantizedArray:
    """Quantize `x` to the block-scaled format `fmt` along the block axis `axis`.

    Args:
      x: bfloat16, float16 or float32 array of rank >= 1 (empty allowed).
      fmt: `jax_fp4.NVFP4(...)` or `jax_fp4.MXFP8(...)`.
      axis: the block axis (consecutive elements along it share a scale). For x[M, K]: -1 = rowwise, 0 =
        columnwise (NVFP4 stores it as the rowwise quantization of x.T; MXFP8 keeps x's shape).
      key: JAX PRNG key; required by NVFP4(stochastic_rounding=True), ignored otherwise.
      scale_layout: "compact" (row-major, matching the data) or "swizzled" (padded 128x4-tile GEMM layout).

    Returns:
      QuantizedArray (see its docstring for every field's shape, dtype and packing).

    Constraints (checked at trace time, ValueError naming the shape, dtype and format):
      dtype bfloat16/float16/float32; rank >= 1; x.shape[axis] % block_size == 0 (16 NVFP4, 32 MXFP8);
      NVFP4 scaling_2d: the other axes flattened % 16 == 0; local_1x64: block axis and other axes % 64 == 0;
      stochastic rounding needs `key`.

    Numerics: NUMERICS.md sections 1-3 (TE `core_nvfp4.cuh`, `quantize_mxfp8.cuh`), bit for bit.
    """
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"quantize: scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
    axis = reference.quantize_module.check_inputs(x, fmt, axis, key)
    q = reference.quantize(x, fmt, axis=axis, key=key)
    scale = q.scale
    if scale_layout == "swizzled":
        scale = reference.swizzle_scales(scale, fmt, axis)
    return QuantizedArray(q.data, scale, q.amax, q.window_amax, fmt=fmt, axis=axis, scale_layout=scale_layout)


def _compact_scale(q: QuantizedArray):
    if q.scale_layout == "compact":
        return q.scale
    return reference.unswizzle_scales(q.scale, q.fmt, q.compact_scale_shape(), q.axis)


def dequantize(q: QuantizedArray, dtype=jnp.float32):
    """Dequantize a QuantizedArray to `dtype` (float32, bfloat16 or float16) with the original x's shape.

    NVFP4: value(q) * ((s_b * amax) * fp32(1/2688)) (TE `dequantize_nvfp4.cuh`); 1x64: value(q) * s_b / S_enc,w;
    RHT tensors get the inverse transform. MXFP8: float(q) * 2**(e - 127). Rounded once to `dtype` (RNE).
    Swizzled scales are read directly (no separate unswizzle by the caller).

    Raises:
      ValueError: `q` is not a QuantizedArray, or `dtype` is not float32/bfloat16/float16.
    """
    if not isinstance(q, QuantizedArray):
        raise ValueError(f"dequantize expects a jax_fp4.QuantizedArray, got {type(q).__name__}")
    return reference.dequantize(q.data, _compact_scale(q), q.amax, q.window_amax, q.fmt, q.axis, dtype)


def swizzle_scales(q: QuantizedArray) -> QuantizedArray:
    """Return `q` with GEMM-swizzled scales (padded [round_up(rows,128), round_up(cols,4)]); no-op if already."""
    if q.scale_layout == "swizzled":
        return q
    s = reference.swizzle_scales(q.scale, q.fmt, q.axis)
    return QuantizedArray(q.data, s, q.amax, q.window_amax, fmt=q.fmt, axis=q.axis, scale_layout="swizzled")


def unswizzle_scales(q: QuantizedArray) -> QuantizedArray:
    """Return `q` with compact scales; exact inverse of `swizzle_scales`."""
    if q.scale_layout == "compact":
        return q
    return QuantizedArray(q.data, _compact_scale(q), q.amax, q.window_amax, fmt=q.fmt, axis=q.axis)
