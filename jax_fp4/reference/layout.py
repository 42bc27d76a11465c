"""Scale layouts: compact <-> padded <-> GEMM-swizzled (docs/numerics.md section 3).

The swizzled layout is cuBLAS/cuDNN's block-scale layout: the padded scale matrix S[R, C] (R % 128 == 0,
C % 4 == 0) is cut into 128x4 tiles of 512 contiguous bytes, tiles in row-major order, and inside a tile the
element S[i, j] sits at (i % 32) * 16 + ((i % 128) // 32) * 4 + (j % 4). Equivalently: reshape to
(R/128, 4, 32, C/4, 4) and permute (0, 3, 2, 1, 4). The swizzled array keeps the padded 2-D shape [R, C].
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from jax_fp4.formats import SCALE_TILE_COLS, SCALE_TILE_ROWS, round_up

__all__ = ["pad_scales", "swizzle", "unswizzle", "scale_matrix", "from_scale_matrix"]


def _as_bytes(s):
    return lax.bitcast_convert_type(s, jnp.uint8) if jnp.dtype(s.dtype).itemsize == 1 and s.dtype != jnp.uint8 else s


def _from_bytes(b, dtype):
    return b if jnp.dtype(dtype) == jnp.uint8 else lax.bitcast_convert_type(b, dtype)


def pad_scales(s):
    """Pad a 2-D scale matrix [R, C] to [round_up(R, 128), round_up(C, 4)] with zero bytes.

    Zero bytes are E4M3 0.0 and E8M0 code 0 (2**-127), the pad values of docs/numerics.md section 3.
    """
    if s.ndim != 2:
        raise ValueError(f"pad_scales expects a 2-D scale matrix, got shape {s.shape}")
    r, c = s.shape
    b = _as_bytes(s)
    b = jnp.pad(b, ((0, round_up(r, SCALE_TILE_ROWS) - r), (0, round_up(c, SCALE_TILE_COLS) - c)))
    return _from_bytes(b, s.dtype)


def swizzle(s):
    """Compact 2-D scales [R, C] (8-bit dtype) -> padded, GEMM-swizzled [round_up(R,128), round_up(C,4)]."""
    p = pad_scales(s)
    r, c = p.shape
    t = p.reshape(r // 128, 4, 32, c // 4, 4).transpose(0, 3, 2, 1, 4)
    return t.reshape(r, c)


def unswizzle(sw, rows: int, cols: int):
    """Inverse of `swizzle`: padded swizzled [R, C] -> compact [rows, cols]."""
    if sw.ndim != 2 or sw.shape[0] % SCALE_TILE_ROWS or sw.shape[1] % SCALE_TILE_COLS:
        raise ValueError(f"unswizzle expects a padded [R%128==0, C%4==0] scale matrix, got shape {sw.shape}")
    if sw.shape != (round_up(rows, SCALE_TILE_ROWS), round_up(cols, SCALE_TILE_COLS)):
        raise ValueError(f"unswizzle: shape {sw.shape} is not the padded shape of a [{rows}, {cols}] scale matrix")
    r, c = sw.shape
    t = sw.reshape(r // 128, c // 4, 32, 4, 4).transpose(0, 3, 2, 1, 4)
    return t.reshape(r, c)[:rows, :cols]


def scale_matrix(scale, axis: int, block_axis_last: bool):
    """Compact scales -> their 2-D [rows, scale columns] view (block axis moved last, others flattened)."""
    s = scale if block_axis_last else jnp.moveaxis(scale, axis, -1)
    return s.reshape(math.prod(s.shape[:-1]), s.shape[-1])


def from_scale_matrix(m, scale_shape, axis: int, block_axis_last: bool):
    """Inverse of `scale_matrix`, back to the compact scale shape."""
    if block_axis_last:
        return m.reshape(scale_shape)
    moved = list(scale_shape)
    n = moved.pop(axis)
    return jnp.moveaxis(m.reshape(tuple(moved) + (n,)), -1, axis)
