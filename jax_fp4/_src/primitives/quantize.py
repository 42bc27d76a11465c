"""`jf4_quantize`: rowwise and/or columnwise block-scaled quantization of x[P, M, K] from one read.

Operands:
  x: bfloat16/float16/float32 [P, M, K]. Rowwise blocks run along K, columnwise blocks along M, per leading p.
  amax_row, amax_col: float32 [P], the tensor amax each NVFP4 1D/2D/RHT orientation encodes with (ignored
    otherwise; for RHT the post-transform amax, see `rht_amax`).
  key_row, key_col: uint32 [2], the Philox key words of NVFP4 stochastic rounding (`reference.sr.philox_key`);
    the element at row-major index i of that orientation's stored data (row_data [P, M, K], col_data [P, K, M])
    takes byte i % 16 of Philox(counter i // 16). Or uint32 [8], the stream words of one shard of a sharded
    quantize (`reference.sr.shard_words`: k0, k1, the shard's offsets in the global stored data and its global
    dims, in stored order: (p, m, k) rowwise, (p, k, m) columnwise), so that i is the global index and a sharded
    SR quantize equals the unsharded one bit for bit (the sharding rule builds them; see `partitioning.py`).
Static parameters: row_fmt, col_fmt (a Format or None; at least one), scale_layout ("compact"/"swizzled"),
  dbias (bool), exact ((bool, bool), rowwise and columnwise; default neither).
Results (always seven; an absent output is a placeholder uint8/float32[0]):
  row_data   NVFP4 float4_e2m1fn[P, M, K] (packed, even index low nibble) | MXFP8 float8[P, M, K]
  row_scale  compact NVFP4 float8_e4m3fn[P, M, K/16] | MXFP8 float8_e8m0fnu[P, M, K/32];
             swizzled: the padded 2-D GEMM layout of the [P*M, K/bs] scale matrix
  row_wamax  float32[P, M, K/64] for NVFP4 1x64
  col_data   NVFP4 float4_e2m1fn[P, K, M] (the rowwise quantization of x[p].T) | MXFP8 float8[P, M, K]
  col_scale  compact NVFP4 float8_e4m3fn[P, K, M/16] | MXFP8 float8_e8m0fnu[P, M/32, K];
             swizzled: the padded GEMM layout of the [P*K, M/bs] scale matrix
  col_wamax  float32[P, K, M/64] for NVFP4 1x64
  dbias      float32[P, ceil(M/64), K]: column sums of x over each 64-row stripe (summed by the caller)
An exact orientation (exact[0] rowwise, exact[1] columnwise; NVFP4 other than 1x64, or MXFP8) returns, in place of
its codes, its GEMM-emulation operand: bfloat16 value(q) * block scale with the data's shape and layout (NVFP4: the
tensor scale amax / 2688 left out, an RHT left in place), bit for bit `jf4_dequantize` of the codes it replaces
(NVFP4 block-scales-only mode, MXFP8 to bfloat16). Its scales and window amax are returned as usual. This fuses the
dequantize of the emulated GEMM into the quantize pass (`jax_fp4.dense`).

Lowerings: CUDA FFI target `jf4_quantize` (cpp/quantize/) when the extension is built, and on the CPU the host
handler of that name (cpp/cpu/) when the CPU extension is built; the bit-exact reference (`jax_fp4.reference`)
otherwise, and for the one layout the kernels do not tile (2D columnwise with P > 1 and K % 16 != 0, whose 16x16
tiles cross p). vmap folds the batch into P (compact scales, no stochastic rounding, unbatched
keys), else maps the reference. Not differentiable (the recipes' custom_vjp never differentiates it). Sharding:
`partitioning.py`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_fp4._src import ffi as _ffi
from jax_fp4._src import ffi_codes
from jax_fp4._src.ffi_codes import QuantizeFlag
from jax_fp4._src.primitives import partitioning
from jax_fp4._src.primitives._common import def_impl, def_not_differentiable
from jax_fp4._src.primitives.dequantize import reference_dequantize
from jax_fp4._src.primitives.partitioning_base import register_lowerings
from jax_fp4.formats import NVFP4, Format, round_up
from jax_fp4.quantized_array import SCALE_LAYOUTS
from jax_fp4.reference import codes, layout, mxfp8, nvfp4

__all__ = ["quantize_p", "quantize_3d", "ffi_attributes", "DBIAS_ROWS", "OUTPUT_NAMES", "SHARD_KEY_WORDS"]

DBIAS_ROWS = 64  # rows per dbias partial sum (the kernel's tile height)
SHARD_KEY_WORDS = 8  # stream words of a shard: k0, k1, 3 offsets, 3 global dims (cpp/quantize/quantize.cuh Args)
OUTPUT_NAMES = ("row_data", "row_scale", "row_wamax", "col_data", "col_scale", "col_wamax", "dbias")

quantize_p = Primitive("jf4_quantize")
quantize_p.multiple_results = True
def_impl(quantize_p)
def_not_differentiable(quantize_p)


def _placeholder(dtype):
    return jax.core.ShapedArray((0,), dtype)


def _orientation_avals(fmt, P, M, K, col, swizzled, exact):
    """(data, scale, window amax) avals of one orientation."""
    if fmt is None:
        return _placeholder(jnp.uint8), _placeholder(jnp.uint8), _placeholder(jnp.float32)
    bs = fmt.block_size
    if fmt.stores_block_axis_last:  # NVFP4: columnwise data is the rowwise quantization of x.T
        rows, n = (K, M) if col else (M, K)
        data = (P, rows, n)
        scale = (P, rows, n // bs)
        wamax = (P, rows, n // fmt.window_size) if fmt.local_1x64 else None
        matrix = (P * rows, n // bs)
    else:
        data = (P, M, K)
        scale = (P, M // bs, K) if col else (P, M, K // bs)
        wamax = None
        matrix = (P * K, M // bs) if col else (P * M, K // bs)
    if swizzled:
        scale = (round_up(matrix[0], 128), round_up(matrix[1], 4))
    wamax_aval = jax.core.ShapedArray(wamax, jnp.float32) if wamax else _placeholder(jnp.float32)
    data_dtype = jnp.bfloat16 if exact else fmt.data_dtype
    return (jax.core.ShapedArray(data, data_dtype), jax.core.ShapedArray(scale, fmt.scale_dtype), wamax_aval)


def _check(x_shape, x_dtype, row_fmt, col_fmt, scale_layout, exact=(False, False)):
    where = f"jf4_quantize: x {jnp.dtype(x_dtype)}{list(x_shape)}"
    if len(x_shape) != 3:
        raise ValueError(f"{where}: expected rank 3 [P, M, K]")
    if row_fmt is None and col_fmt is None:
        raise ValueError(f"{where}: no rowwise or columnwise format requested")
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"{where}: scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
    for fmt, axis in ((row_fmt, -1), (col_fmt, -2)):
        if fmt is not None:
            if not isinstance(fmt, Format):
                raise ValueError(f"{where}: expected a jax_fp4 Format, got {fmt!r}")
            fmt.validate(x_shape, x_dtype, axis)
    if not (isinstance(exact, tuple) and len(exact) == 2 and all(isinstance(e, bool) for e in exact)):
        raise ValueError(f"{where}: exact must be a (rowwise, columnwise) pair of bools, got {exact!r}")
    for fmt, on, side in ((row_fmt, exact[0], "rowwise"), (col_fmt, exact[1], "columnwise")):
        if on and (fmt is None or not fmt.exact_operand_ok):
            raise ValueError(f"{where}: no exact {side} operand for {fmt!r} (needs NVFP4 1D/2D/RHT or MXFP8; 1x64 "
                             "window scales do not factor out of a GEMM)")


def _abstract_eval(x, amax_row, amax_col, key_row, key_col, *, row_fmt, col_fmt, scale_layout, dbias,
                   exact=(False, False), local=False):
    _check(x.shape, x.dtype, row_fmt, col_fmt, scale_layout, exact)
    P, M, K = x.shape
    for name, a, shape, dt in (("amax_row", amax_row, (P,), jnp.float32), ("amax_col", amax_col, (P,), jnp.float32),
                               ("key_row", key_row, (2,), jnp.uint32), ("key_col", key_col, (2,), jnp.uint32)):
        if (a.shape != shape and not (name.startswith("key") and a.shape == (SHARD_KEY_WORDS,))) or a.dtype != dt:
            alt = f" (or {jnp.dtype(dt)}[{SHARD_KEY_WORDS}], a shard's stream words)" if name.startswith("key") else ""
            raise ValueError(f"jf4_quantize: {name} must be {jnp.dtype(dt)}{list(shape)}{alt}, got "
                             f"{a.dtype}{list(a.shape)}")
    swz = scale_layout == "swizzled"
    outs = (_orientation_avals(row_fmt, P, M, K, False, swz, exact[0])
            + _orientation_avals(col_fmt, P, M, K, True, swz, exact[1]))
    db = jax.core.ShapedArray((P, -(-M // DBIAS_ROWS), K), jnp.float32) if dbias else _placeholder(jnp.float32)
    return (*outs, db)


quantize_p.def_abstract_eval(_abstract_eval)


# ---- reference lowering -----------------------------------------------------------------------------------------
def _exact_values(fmt, data, scale, mx_columnwise):
    """bfloat16 value(q) * block scale of compact codes (the `jf4_dequantize` reference, block scales only)."""
    empty = jnp.zeros((0,), jnp.float32)
    # inverse_rht=False: the RHT cancels in the product of two RHT operands
    return reference_dequantize(data, scale, empty, empty, fmt=fmt, out_dtype=jnp.bfloat16, scale_layout="compact",
                                mx_columnwise=mx_columnwise, transpose_out=False, inverse_rht=False)


def _reference_orientation(y, fmt, amax, key_words, col, swizzled, exact=False):
    """y: x (row) or x with M and K swapped (col), block axis last; returns (data, scale, wamax)."""
    wamax = jnp.zeros((0,), jnp.float32)
    if isinstance(fmt, NVFP4):
        y = nvfp4.prepare(y, fmt)
        if fmt.local_1x64:
            parts = nvfp4.quantize_1x64(y)
            wamax = parts.window_amax
        else:
            words = key_words if fmt.stochastic_rounding else None
            parts = nvfp4.quantize_with_amax(y, fmt, amax[:, None, None], words)
        data, sc = codes.to_dtype(parts.codes, fmt.data_dtype), parts.scale_codes
    else:
        q, sc = mxfp8.quantize(y, fmt)
        data = codes.to_dtype(q, fmt.data_dtype)
        if col:
            data = jnp.swapaxes(data, 1, 2)
    scale = codes.to_dtype(sc, fmt.scale_dtype)  # block axis last
    if exact:
        mx_col = col and not fmt.stores_block_axis_last
        data = _exact_values(fmt, data, jnp.swapaxes(scale, 1, 2) if mx_col else scale, mx_col)
    if swizzled:
        scale = layout.swizzle(scale.reshape(math.prod(scale.shape[:-1]), scale.shape[-1]))
    elif col and not fmt.stores_block_axis_last:  # MXFP8 columnwise scales [P, M/32, K]
        scale = jnp.swapaxes(scale, 1, 2)
    return data, scale, wamax


def reference_outputs(x, amax_row, amax_col, key_row, key_col, *, row_fmt, col_fmt, scale_layout, dbias,
                      exact=(False, False)):
    """The primitive's semantics in pure jnp (its default lowering, and the vmap fallback)."""
    swz = scale_layout == "swizzled"
    outs = []
    for fmt, y, amax, kw, col, ex in ((row_fmt, x, amax_row, key_row, False, exact[0]),
                                      (col_fmt, jnp.swapaxes(x, 1, 2), amax_col, key_col, True, exact[1])):
        if fmt is None:
            outs += [jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), jnp.float32)]
        else:
            outs += list(_reference_orientation(y, fmt, amax, kw, col, swz, ex))
    outs.append(_reference_dbias(x) if dbias else jnp.zeros((0,), jnp.float32))
    return tuple(outs)


def _reference_dbias(x):
    P, M, K = x.shape
    t = -(-M // DBIAS_ROWS)
    xf = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, t * DBIAS_ROWS - M), (0, 0)))
    return jnp.sum(xf.reshape(P, t, DBIAS_ROWS, K), axis=2)


_reference_lowering = mlir.lower_fun(reference_outputs, multiple_results=True)


# ---- CUDA lowering ----------------------------------------------------------------------------------------------
def ffi_attributes(row_fmt, col_fmt, scale_layout, dbias, exact=(False, False)) -> dict:
    """The `jf4_quantize` attributes (np.int32 row_kind, col_kind, flags; the codes of jax_fp4/_src/ffi_codes.py)."""
    flags = ffi_codes.quantize_options(row_fmt) | (ffi_codes.quantize_options(col_fmt) << ffi_codes.COL_SHIFT)
    flags |= (QuantizeFlag.SWIZZLED if scale_layout == "swizzled" else 0) | (QuantizeFlag.DBIAS if dbias else 0)
    flags |= (QuantizeFlag.ROW_EXACT if exact[0] else 0) | (QuantizeFlag.COL_EXACT if exact[1] else 0)
    return dict(row_kind=np.int32(ffi_codes.kind(row_fmt)), col_kind=np.int32(ffi_codes.kind(col_fmt)),
                flags=np.int32(flags))


def kernel_supports(shape, row_fmt, col_fmt) -> bool:
    """Whether the CUDA kernel tiles this case (else the CUDA lowering runs the reference)."""
    P, M, K = shape
    for fmt, other in ((row_fmt, M), (col_fmt, K)):
        if fmt is not None and fmt.scaling_2d and P > 1 and other % fmt.tile_2d:
            return False
    return P * M * K < 2**40


def _kernel_pairing(row_fmt, col_fmt, dbias) -> bool:
    """Pairings one kernel launch serves (cpp/quantize/quantize_ffi.cu `Supported`): one orientation alone (no
    dbias without a columnwise output), NVFP4 rowwise with any columnwise format, MXFP8 with the same MXFP8."""
    if row_fmt is None or col_fmt is None:
        return not (dbias and col_fmt is None)
    return isinstance(row_fmt, NVFP4) or row_fmt == col_fmt


def _split(x, amax_row, amax_col, key_row, key_col, *, row_fmt, col_fmt, scale_layout, dbias, exact=(False, False)):
    """Two launches (rowwise, then columnwise) for pairings one launch does not serve."""
    empty = [jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), jnp.float32)]
    outs = list(empty)
    if row_fmt is not None:
        outs = list(quantize_p.bind(x, amax_row, amax_col, key_row, key_col, row_fmt=row_fmt, col_fmt=None,
                                    scale_layout=scale_layout, dbias=False, exact=(exact[0], False),
                                    local=True)[:3])
    db = jnp.zeros((0,), jnp.float32)
    if col_fmt is not None:
        c = quantize_p.bind(x, amax_row, amax_col, key_row, key_col, row_fmt=None, col_fmt=col_fmt,
                            scale_layout=scale_layout, dbias=dbias, exact=(False, exact[1]), local=True)
        outs += list(c[3:6])
        db = c[6]
    else:
        outs += empty
        if dbias:
            db = _reference_dbias(x)
    return (*outs, db)


_split_lowering = mlir.lower_fun(_split, multiple_results=True)


def _cuda_lowering(ctx, x, amax_row, amax_col, key_row, key_col, *, row_fmt, col_fmt, scale_layout, dbias,
                   exact=(False, False)):
    params = dict(row_fmt=row_fmt, col_fmt=col_fmt, scale_layout=scale_layout, dbias=dbias, exact=exact)
    if not kernel_supports(ctx.avals_in[0].shape, row_fmt, col_fmt):
        return _reference_lowering(ctx, x, amax_row, amax_col, key_row, key_col, **params)
    if not _kernel_pairing(row_fmt, col_fmt, dbias):
        return _split_lowering(ctx, x, amax_row, amax_col, key_row, key_col, **params)
    rule = jax.ffi.ffi_lowering("jf4_quantize")
    return rule(ctx, x, amax_row, amax_col, key_row, key_col,
                **ffi_attributes(row_fmt, col_fmt, scale_layout, dbias, exact))


# The CPU handler (cpp/cpu/) takes the same operands, attributes and pairings as the CUDA one.
register_lowerings(quantize_p, partitioning.quantize, _reference_lowering,
                   cuda=_cuda_lowering if _ffi.ensure_registered() else None,
                   cpu=_cuda_lowering if _ffi.has_cpu_target("jf4_quantize") else None)


# ---- batching ---------------------------------------------------------------------------------------------------
def _batch_rule(args, dims, **params):
    bind_params = dict(params)
    params.pop("local", None)
    x, amax_row, amax_col, key_row, key_col = args
    bx, bar, bac, bkr, bkc = dims
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)

    def lead(a, d):
        return jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)

    x, amax_row, amax_col = lead(x, bx), lead(amax_row, bar), lead(amax_col, bac)
    sr = any(f is not None and f.needs_key for f in (params["row_fmt"], params["col_fmt"]))
    # Folding into P is exact only where the result of example b does not depend on b's position: per-example SR
    # streams restart at counter 0 and swizzled layouts pad per example, so those run one quantize per example in a
    # loop (lax.map: the kernel, or the reference where there is none, compiled once for all examples; a vmap of the
    # reference compiled the whole bit-exact reference, minutes on a CPU).
    if sr or bkr is not None or bkc is not None or params["scale_layout"] != "compact":
        outs = jax.lax.map(lambda a: tuple(quantize_p.bind(*a, **bind_params)),
                           (x, amax_row, amax_col, lead(key_row, bkr), lead(key_col, bkc)))
        return list(outs), [0] * len(outs)
    B, P = x.shape[:2]
    outs = quantize_p.bind(x.reshape(B * P, *x.shape[2:]), amax_row.reshape(-1), amax_col.reshape(-1), key_row,
                           key_col, **params)
    res, res_dims = [], []
    for o in outs:
        if o.shape == (0,):
            res.append(o)
            res_dims.append(None)
        else:
            res.append(o.reshape(B, P, *o.shape[1:]))
            res_dims.append(0)
    return res, res_dims


batching.primitive_batchers[quantize_p] = _batch_rule


def quantize_3d(x3, amax_row, amax_col, key_row, key_col, *, row_fmt, col_fmt, scale_layout="compact", dbias=False,
                exact=(False, False)):
    """Bind the primitive (see the module docstring); returns a dict of the seven results by name."""
    outs = quantize_p.bind(x3, amax_row, amax_col, key_row, key_col, row_fmt=row_fmt, col_fmt=col_fmt,
                           scale_layout=scale_layout, dbias=bool(dbias), exact=(bool(exact[0]), bool(exact[1])))
    return dict(zip(OUTPUT_NAMES, outs, strict=True))

