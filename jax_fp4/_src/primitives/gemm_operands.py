"""The operands of the block-scaled GEMM routes, packed from `jax_fp4.QuantizedArray`s.

`kernel_operand` gives the `jf4_gemm` operand triple (jax_fp4/_src/primitives/gemm.py: K-major data, compact
scales, aux); `native_operand` the `jax.nn.scaled_matmul` pair. Both move the block (contracting) axis last: NVFP4
stores it there already; MXFP8 data and scales blocked along another axis are transposed (1-byte arrays). Swizzled
scales are unswizzled (`jf4_unswizzle`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jax_fp4._src.primitives._common import empty_operand
from jax_fp4._src.primitives.swizzle import compact_scales
from jax_fp4.quantized_array import QuantizedArray
from jax_fp4.reference.nvfp4 import decode_amax

__all__ = ["kernel_operand", "native_operand"]


def _block_axis_last(q: QuantizedArray):
    """(data, compact scales) of q with the block axis last."""
    scale = compact_scales(q)
    if q.fmt.stores_block_axis_last:
        return q.data, scale
    return jnp.moveaxis(q.data, q.axis, -1), jnp.moveaxis(scale, q.axis, -1)


def native_operand(q: QuantizedArray):
    """[1, rows, K] data and [1, rows, K/bs] scales of q (2-D, blocked along its contracting axis) for
    `jax.nn.scaled_matmul`."""
    data, scale = _block_axis_last(q)
    return data[None], scale[None]


def kernel_operand(q: QuantizedArray):
    """((data [rows, K], compact scales [rows, K/bs], aux), free shape) of the `jf4_gemm` operand of q.

    rows = prod(free shape), the axes of q other than its block axis, in order. aux: the 1x64 window amax
    float32 [rows, K/64], decode_amax(amax) (NVFP4 with a tensor amax; the primitive's docstring says why) or
    float32[0].
    """
    fmt, k = q.fmt, q.shape[q.axis]
    data, scale = _block_axis_last(q)
    free = tuple(data.shape[:-1])
    rows = math.prod(free)
    if fmt.local_1x64:
        aux = q.window_amax.reshape(rows, k // fmt.window_size)
    elif fmt.has_tensor_amax:
        aux = decode_amax(q.amax)
    else:
        aux = empty_operand(data)
    return (data.reshape(rows, k), scale.reshape(rows, k // fmt.block_size), aux), free
