"""`jf4_swizzle` / `jf4_unswizzle`: compact block-scale matrices <-> the padded GEMM-swizzled layout
(docs/numerics.md section 3).

Operands and results (leading dimensions, if any, are independent matrices stored one after the other):
  jf4_swizzle:   s: 8-bit [..., rows, cols]  ->  [..., Rp, Cp], same dtype
  jf4_unswizzle: sw: 8-bit [..., Rp, Cp] and static ints rows, cols  ->  [..., rows, cols], same dtype
with Rp = round_up(rows, 128), Cp = round_up(cols, 4). The swizzled matrix is cut into 128x4 tiles of 512
contiguous bytes in row-major tile order; inside a tile S[i, j] sits at (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4.
Padding is zero bytes (E4M3 +0, E8M0 code 0). 8-bit dtypes: float8_e4m3fn, float8_e8m0fnu, float8_e5m2, uint8, int8.

Constraints (abstract eval, `ValueError` naming the shape and dtype): rank >= 2; one of the 8-bit dtypes above;
unswizzle: rows, cols >= 0 and sw.shape[-2:] == (round_up(rows, 128), round_up(cols, 4)).

Lowerings: CUDA FFI targets `jf4_swizzle` / `jf4_unswizzle` (cpp/swizzle/) when the extension is built, on the
CPU the host handlers of those names (cpp/cpu/) when the CPU extension is built, the
reference (`jax_fp4.reference.layout.swizzle` / `unswizzle`) elsewhere; bit-identical, exact inverses
(unswizzle(swizzle(s)) == s). Empty matrices launch nothing. vmap: the batch dimension becomes a leading dimension.
Sharding (partitioning.py): leading dimensions parallel, the rows in whole 128-row tiles, the columns gathered.
Autodiff: stop_gradient semantics (zero tangents; scales are codes).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_fp4._src import ffi as _ffi
from jax_fp4._src.primitives import partitioning
from jax_fp4._src.primitives._common import def_impl
from jax_fp4._src.primitives.partitioning_base import register_lowerings
from jax_fp4.formats import SCALE_TILE_COLS, SCALE_TILE_ROWS, round_up
from jax_fp4.reference import layout

__all__ = ["BYTE_DTYPES", "swizzle_p", "unswizzle_p", "swizzle", "unswizzle", "padded_shape", "compact_scales"]

#: The scale dtypes the primitives accept (any 8-bit code: only the bytes move).
BYTE_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e8m0fnu, jnp.float8_e5m2, jnp.uint8,
                                           jnp.int8))

swizzle_p = Primitive("jf4_swizzle")
unswizzle_p = Primitive("jf4_unswizzle")
def_impl(swizzle_p)
def_impl(unswizzle_p)


def padded_shape(rows: int, cols: int) -> tuple[int, int]:
    """(round_up(rows, 128), round_up(cols, 4)): the padded / swizzled matrix of a [rows, cols] scale matrix."""
    return round_up(rows, SCALE_TILE_ROWS), round_up(cols, SCALE_TILE_COLS)


def _check(name, shape, dtype):
    where = f"{name}: scales {jnp.dtype(dtype).name}{list(shape)}"
    if len(shape) < 2:
        raise ValueError(f"{where}: expected a scale matrix of rank >= 2 [..., rows, cols]")
    if jnp.dtype(dtype) not in BYTE_DTYPES:
        raise ValueError(f"{where}: expected an 8-bit scale dtype ({', '.join(d.name for d in BYTE_DTYPES)})")
    return where


def _swizzle_abstract(s, *, local=False):
    _check("jf4_swizzle", s.shape, s.dtype)
    return jax.core.ShapedArray((*s.shape[:-2], *padded_shape(*s.shape[-2:])), s.dtype)


def _unswizzle_abstract(sw, *, rows, cols, local=False):
    where = _check("jf4_unswizzle", sw.shape, sw.dtype)
    if not (isinstance(rows, int) and isinstance(cols, int) and rows >= 0 and cols >= 0):
        raise ValueError(f"{where}: rows and cols must be non-negative ints, got rows={rows!r}, cols={cols!r}")
    if tuple(sw.shape[-2:]) != padded_shape(rows, cols):
        raise ValueError(f"{where}: the last two dimensions must be [round_up(rows, 128), round_up(cols, 4)] = "
                         f"{list(padded_shape(rows, cols))} for a [{rows}, {cols}] scale matrix")
    return jax.core.ShapedArray((*sw.shape[:-2], rows, cols), sw.dtype)


swizzle_p.def_abstract_eval(_swizzle_abstract)
unswizzle_p.def_abstract_eval(_unswizzle_abstract)


# ---- reference lowering -----------------------------------------------------------------------------------------
def _per_matrix(fn, a, out_last2):
    """Apply the 2-D `fn` to every matrix of a [..., r, c] (leading dimensions flattened and mapped), on the bytes:
    XLA:CPU may move float8_e5m2 through a float conversion that changes NaN payloads (0x7D -> 0x7F)."""
    lead = a.shape[:-2]
    if a.size == 0 or math.prod(out_last2) == 0:  # an empty matrix (or batch) maps to an empty one
        return jnp.zeros((*lead, *out_last2), a.dtype)
    b = a if a.dtype == jnp.uint8 else lax.bitcast_convert_type(a, jnp.uint8)
    if a.ndim == 2:
        out = fn(b)
    else:
        out = jax.vmap(fn)(b.reshape(math.prod(lead), *a.shape[-2:])).reshape(*lead, *out_last2)
    return out if a.dtype == jnp.uint8 else lax.bitcast_convert_type(out, a.dtype)


def reference_swizzle(s):
    """The primitive's semantics in pure jnp: `jax_fp4.reference.layout.swizzle` per matrix."""
    return _per_matrix(layout.swizzle, s, padded_shape(*s.shape[-2:]))


def reference_unswizzle(sw, *, rows, cols):
    """The primitive's semantics in pure jnp: `jax_fp4.reference.layout.unswizzle` per matrix."""
    return _per_matrix(lambda m: layout.unswizzle(m, rows, cols), sw, (rows, cols))


# ---- CUDA lowering ----------------------------------------------------------------------------------------------
def _cuda_swizzle(ctx, s):
    return jax.ffi.ffi_lowering("jf4_swizzle")(ctx, s)


def _cuda_unswizzle(ctx, sw, *, rows, cols):
    del rows, cols  # the result's shape carries them
    return jax.ffi.ffi_lowering("jf4_unswizzle")(ctx, sw)


_CUDA = _ffi.has_cuda_target("jf4_swizzle", "jf4_unswizzle")
_CPU = _ffi.has_cpu_target("jf4_swizzle", "jf4_unswizzle")  # the host handlers (cpp/cpu/)
register_lowerings(swizzle_p, partitioning.swizzle, mlir.lower_fun(reference_swizzle, multiple_results=False),
                   cuda=_cuda_swizzle if _CUDA else None, cpu=_cuda_swizzle if _CPU else None)
register_lowerings(unswizzle_p, partitioning.swizzle, mlir.lower_fun(reference_unswizzle, multiple_results=False),
                   cuda=_cuda_unswizzle if _CUDA else None, cpu=_cuda_unswizzle if _CPU else None)


# ---- batching: the batch dimension becomes a leading (matrix) dimension ------------------------------------------
def _batch(prim):
    def rule(args, dims, **params):
        params.pop("local", None)
        (a,), (d,) = args, dims
        return prim.bind(jnp.moveaxis(a, d, 0), **params), 0

    return rule


batching.primitive_batchers[swizzle_p] = _batch(swizzle_p)
batching.primitive_batchers[unswizzle_p] = _batch(unswizzle_p)
ad.defjvp(swizzle_p, None)
ad.defjvp(unswizzle_p, None)


def swizzle(s):
    """Compact scales [..., rows, cols] (8-bit) -> GEMM-swizzled [..., round_up(rows, 128), round_up(cols, 4)]."""
    return swizzle_p.bind(jnp.asarray(s))


def unswizzle(sw, rows: int, cols: int):
    """Inverse of `swizzle`: [..., round_up(rows, 128), round_up(cols, 4)] -> compact [..., rows, cols]."""
    return unswizzle_p.bind(jnp.asarray(sw), rows=int(rows), cols=int(cols))


def compact_scales(q):
    """The compact block scales of a `jax_fp4.QuantizedArray` q (`q.compact_scale_shape()`): q.scale itself when
    compact, else its swizzled scales through `jf4_unswizzle`."""
    if q.scale_layout == "compact":
        return q.scale
    m = unswizzle(q.scale, *q.fmt.scale_matrix_shape(q.shape, q.axis))
    return layout.from_scale_matrix(m, q.compact_scale_shape(), q.axis, q.fmt.stores_block_axis_last)
