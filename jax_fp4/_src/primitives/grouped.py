"""`jf4_grouped_quantize` / `jf4_grouped_dequantize`: grouped (MoE) block-scaled quantization (docs/numerics.md s4).

N tensors x_g [M_g, K_g] of one dtype live in one contiguous buffer, group g at flat element offset
offsets[g] = sum_{i<g} M_i K_i, row-major; the representation (`reference.grouped.Representation`) says which
dims vary. The group dims are device arrays (a router's output), never read on the host.

jf4_grouped_quantize
  Operands:
    x: bfloat16 / float16 / float32 [R, C] (SAME_BOTH_DIMS [N*M, K], VARYING_FIRST_DIM [sum M_g, K],
      VARYING_LAST_DIM [M, sum K_g], nominal) or [L] (VARYING_BOTH_DIMS).
    first_dims, last_dims: int32[N], every group's M_g and K_g (static dims materialized by the caller).
    key_row, key_col: uint32[N, 2], per-group Philox key words of NVFP4 stochastic rounding
      (`reference.grouped.group_key_words`: group g uses philox_key(fold_in(key, g))); ignored otherwise.
    amax_in: float32[2N] given per-group NVFP4 tensor amaxes (rowwise, then columnwise; after the RHT for RHT
      formats) for the orientations `amax_given` names, else float32[0].
  Static parameters: row_fmt, col_fmt (a Format or None, at least one), representation, dbias (bool), amax_given
    (int: bit 0 the rowwise, bit 1 the columnwise NVFP4 orientation encodes with amax_in's amaxes instead of computing
    them; only NVFP4 orientations may be named).
  Results (always seven; an absent one is a placeholder uint8 / float32 [0]):
    row_data   [x.size]       NVFP4 float4_e2m1fn (packed two per byte on GPU, even index in the low nibble) |
                              MXFP8 float8_e4m3fn / float8_e5m2; each group's data flattened at offsets[g]
    row_scale  [x.size // bs] float8_e4m3fn | float8_e8m0fnu; each group's compact scales at offsets[g] // bs
    row_amax   float32[N]     per-group tensor amax (NVFP4; after the RHT for RHT formats; the given one if any)
    col_data, col_scale, col_amax   the same for the columnwise quantization (NVFP4: of every x_g.T)
    dbias      float32 [N, K] (SAME_BOTH_DIMS / VARYING_FIRST_DIM) or [C] (VARYING_LAST_DIM, group g at
               sum(K_<g)): per-group column sums, fp32 in an unspecified order (not bit-exact)
  Every group equals the single-tensor `jax_fp4.reference.quantize` of x_g bit for bit; buffer positions past the
  last group hold code 0.

jf4_grouped_dequantize
  Operands: data [L], scale [L // bs] (as above), amax float32[N] (NVFP4 with raw=False, else float32[0]),
    first_dims, last_dims int32[N].
  Static parameters: fmt, axis (-1 rowwise / 0 columnwise), x_shape (L = prod(x_shape)), out_dtype (float32 /
    bfloat16 / float16), raw (bool: block-scaled values without the NVFP4 tensor scale and without the inverse RHT,
    exact in float32: the GEMM emulation's operand).
  Result: out_dtype[x_shape], positions outside every group 0.

Constraints (abstract eval, `ValueError` naming shapes, dtypes and formats). Formats: NVFP4 1D, optionally RHT and
/ or stochastic rounding, and MXFP8 E4M3 / E5M2 (NVFP4 2D and 1x64 are single-tensor formats). Alignment: the block
axis of every group (K_g rowwise, M_g columnwise) must be a whole number of blocks (16 NVFP4 -- also the RHT's
16-chunk -- and 32 MXFP8), so a block never spans two rows of a group and every group's scales are its
single-tensor scales. Abstract eval enforces it where the length is a static dim of x (rowwise: K of SAME_BOTH_DIMS
/ VARYING_FIRST_DIM; columnwise: M of SAME_BOTH_DIMS / VARYING_LAST_DIM); `jax_fp4.grouped_quantize` also checks
concrete sizes; traced sizes are checked on the device: a misaligned group is poisoned (NaN scales, NaN MXFP8 data,
NaN NVFP4 amax), see `jax_fp4.reference.grouped`. Empty groups are legal. x.size < 2**31 (int32 offsets).

Lowerings: the bit-exact reference (`reference.grouped.quantize_groups` / `dequantize_groups` / `column_sums`)
by default; on CUDA, when the extension is built, the FFI targets `jf4_grouped_quantize` /
`jf4_grouped_dequantize` (cpp/grouped/: one persistent launch over all groups each, same bits; see the CUDA section
below); on the CPU, when the CPU extension is built, the host handlers of the same names (cpp/cpu/grouped_*_cpu.cc:
same operands and bits, any number of groups). vmap: `lax.map` over the batch (one unbatched call per example, so
a kernel lowering serves batched calls too). Not differentiable (ragged_dot's custom VJP never differentiates it).
Sharding: `partitioning.py` (the grouped row axis is gathered; K is parallel for MXFP8 quantize and MXFP8 / NVFP4
rowwise dequantize of SAME_BOTH_DIMS / VARYING_FIRST_DIM, otherwise the call is replicated); `local` (set by the
rule's per-shard bind) is accepted by every rule and dropped by the lowering wrapper.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_fp4 import validation
from jax_fp4._src import ffi as _ffi
from jax_fp4._src import ffi_codes
from jax_fp4._src.ffi_codes import GroupedDequantizeFlag, QuantizeOption
from jax_fp4._src.primitives import partitioning_grouped
from jax_fp4._src.primitives._common import def_impl, def_not_differentiable, empty_operand
from jax_fp4._src.primitives.partitioning_base import register_lowerings
from jax_fp4.formats import NVFP4, Format
from jax_fp4.reference import codes
from jax_fp4.reference import grouped as ref
from jax_fp4.validation import Representation

__all__ = ["grouped_quantize_p", "grouped_dequantize_p", "grouped_quantize_raw", "grouped_dequantize_raw",
           "OUTPUT_NAMES", "OUT_DTYPES"]

OUTPUT_NAMES = ("row_data", "row_scale", "row_amax", "col_data", "col_scale", "col_amax", "dbias")
OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_FLOAT_INPUTS = OUT_DTYPES
_ShapedArray = jax.core.ShapedArray

grouped_quantize_p = Primitive("jf4_grouped_quantize")
grouped_quantize_p.multiple_results = True
def_impl(grouped_quantize_p)
def_not_differentiable(grouped_quantize_p)
grouped_dequantize_p = Primitive("jf4_grouped_dequantize")
def_impl(grouped_dequantize_p)


def _placeholder(dtype):
    return _ShapedArray((0,), dtype)


def _tensor_scale(fmt) -> bool:
    return fmt is not None and fmt.has_tensor_amax


def _check_dims(where, first_dims, last_dims):
    n = first_dims.shape[0] if len(first_dims.shape) == 1 else -1
    for name, d in (("first_dims", first_dims), ("last_dims", last_dims)):
        if d.shape != (n,) or d.dtype != jnp.int32 or n < 1:
            raise ValueError(f"{where}: {name} must be int32[N] with N >= 1 and the same N for both, got "
                             f"first_dims {first_dims.dtype}{list(first_dims.shape)}, last_dims "
                             f"{last_dims.dtype}{list(last_dims.shape)}")
    return n


def _check_x(where, shape, rep, n):
    want = 1 if rep is Representation.VARYING_BOTH_DIMS else 2
    if len(shape) != want:
        raise ValueError(f"{where}: {rep.value} needs a {want}-D buffer, got shape {tuple(shape)}")
    if rep is Representation.SAME_BOTH_DIMS and shape[0] % n:
        raise ValueError(f"{where}: SAME_BOTH_DIMS buffer {tuple(shape)}: rows not divisible by N = {n} groups")
    if math.prod(shape) >= 2**31:
        raise ValueError(f"{where}: buffer {tuple(shape)} has >= 2**31 elements (int32 offsets)")


def _orientation_avals(fmt, size, n):
    if fmt is None:
        return _placeholder(jnp.uint8), _placeholder(jnp.uint8), _placeholder(jnp.float32)
    amax = _ShapedArray((n,), jnp.float32) if _tensor_scale(fmt) else _placeholder(jnp.float32)
    return (_ShapedArray((size,), fmt.data_dtype), _ShapedArray((size // fmt.block_size,), fmt.scale_dtype), amax)


def _check_amax_in(where, amax_in, amax_given, n, row_fmt, col_fmt):
    if not isinstance(amax_given, int) or not 0 <= amax_given <= 3:
        raise ValueError(f"{where}: amax_given must be an int in 0..3, got {amax_given!r}")
    for bit, fmt, side in ((1, row_fmt, "rowwise"), (2, col_fmt, "columnwise")):
        if amax_given & bit and not _tensor_scale(fmt):
            raise ValueError(f"{where}: a given {side} amax needs an NVFP4 {side} format, got {fmt!r}")
    want = (2 * n,) if amax_given else (0,)
    if amax_in.shape != want or amax_in.dtype != jnp.float32:
        raise ValueError(f"{where}: amax_in must be float32{list(want)} with amax_given {amax_given}, got "
                         f"{amax_in.dtype}{list(amax_in.shape)}")


def _quantize_abstract_eval(x, first_dims, last_dims, key_row, key_col, amax_in, *, row_fmt, col_fmt,
                            representation, dbias, amax_given):
    where = f"jf4_grouped_quantize: x {jnp.dtype(x.dtype)}{list(x.shape)}"
    if not isinstance(representation, Representation):
        raise ValueError(f"{where}: representation must be a jax_fp4.reference.grouped.Representation, got "
                         f"{representation!r}")
    if jnp.dtype(x.dtype) not in _FLOAT_INPUTS:
        raise ValueError(f"{where}: x must be bfloat16, float16 or float32")
    if row_fmt is None and col_fmt is None:
        raise ValueError(f"{where}: no rowwise or columnwise format requested")
    n = _check_dims(where, first_dims, last_dims)
    _check_x(where, x.shape, representation, n)
    for name, k in (("key_row", key_row), ("key_col", key_col)):
        if k.shape != (n, 2) or k.dtype != jnp.uint32:
            raise ValueError(f"{where}: {name} must be uint32[{n}, 2] (per-group Philox key words), got "
                             f"{k.dtype}{list(k.shape)}")
    _check_amax_in(where, amax_in, amax_given, n, row_fmt, col_fmt)
    for fmt, axis in ((row_fmt, -1), (col_fmt, 0)):
        if fmt is not None:
            if not isinstance(fmt, Format):
                raise ValueError(f"{where}: expected a jax_fp4 Format, got {fmt!r}")
            validation.check_format(fmt, key=True, what="jf4_grouped_quantize")
            validation.check_static_alignment(x.shape, representation, n, axis == 0, fmt, "jf4_grouped_quantize")
    size = math.prod(x.shape)
    outs = _orientation_avals(row_fmt, size, n) + _orientation_avals(col_fmt, size, n)
    if not dbias:
        db = _placeholder(jnp.float32)
    elif representation is Representation.VARYING_BOTH_DIMS:
        raise ValueError(f"{where}: dbias needs a static column count (SAME_BOTH_DIMS, VARYING_FIRST_DIM or "
                         f"VARYING_LAST_DIM), not VARYING_BOTH_DIMS")
    elif representation is Representation.VARYING_LAST_DIM:
        db = _ShapedArray((x.shape[1],), jnp.float32)
    else:
        db = _ShapedArray((n, x.shape[1]), jnp.float32)
    return (*outs, db)


grouped_quantize_p.def_abstract_eval(lambda *a, local=False, **p: _quantize_abstract_eval(*a, **p))


def _dequantize_abstract_eval(data, scale, amax, first_dims, last_dims, *, fmt, axis, x_shape, out_dtype, raw):
    where = f"jf4_grouped_dequantize {fmt!r}: data {jnp.dtype(data.dtype)}{list(data.shape)}"
    if not isinstance(fmt, Format):
        raise ValueError(f"{where}: expected a jax_fp4 Format, got {fmt!r}")
    if axis not in (-1, 0):
        raise ValueError(f"{where}: axis must be -1 (rowwise) or 0 (columnwise), got {axis!r}")
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"{where}: output dtype must be float32, bfloat16 or float16, got {out_dtype}")
    n = _check_dims(where, first_dims, last_dims)
    size, bs = math.prod(x_shape), fmt.block_size
    if data.shape != (size,) or data.dtype != jnp.dtype(fmt.data_dtype):
        raise ValueError(f"{where}: data must be {jnp.dtype(fmt.data_dtype)}[{size}] for x_shape {tuple(x_shape)}")
    if scale.shape != (size // bs,) or scale.dtype != jnp.dtype(fmt.scale_dtype):
        raise ValueError(f"{where}: scale must be {jnp.dtype(fmt.scale_dtype)}[{size // bs}], got "
                         f"{scale.dtype}{list(scale.shape)}")
    want = (n,) if _tensor_scale(fmt) and not raw else (0,)
    if amax.shape != want or amax.dtype != jnp.float32:
        raise ValueError(f"{where}: amax must be float32{list(want)}, got {amax.dtype}{list(amax.shape)}")
    return _ShapedArray(tuple(x_shape), out_dtype)


grouped_dequantize_p.def_abstract_eval(lambda *a, local=False, **p: _dequantize_abstract_eval(*a, **p))


# ---- reference lowering (every platform; CUDA below when the extension is built) ----------------------------------
def reference_quantize(x, first_dims, last_dims, key_row, key_col, amax_in, *, row_fmt, col_fmt, representation, dbias,
                       amax_given):
    """The primitive's semantics in pure jnp (its default lowering)."""
    outs, n = [], first_dims.shape[0]
    for o, (fmt, axis, kw) in enumerate(((row_fmt, -1, key_row), (col_fmt, 0, key_col))):
        if fmt is None:
            outs += [jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), jnp.float32)]
            continue
        words = kw if fmt.needs_key else None
        given = amax_in[o * n : (o + 1) * n] if amax_given & (1 << o) else None
        data, scale, amax = ref.quantize_groups(x, first_dims, last_dims, fmt, axis, words, amax=given)
        outs += [data, scale, jnp.zeros((0,), jnp.float32) if amax is None else amax]
    outs.append(ref.column_sums(x, first_dims, last_dims, representation) if dbias
                else jnp.zeros((0,), jnp.float32))
    return tuple(outs)


def reference_dequantize(data, scale, amax, first_dims, last_dims, *, fmt, axis, x_shape, out_dtype, raw):
    # Keep the codes' producers out of the decode's fusions (see dequantize.reference_dequantize: jax >= 0.11 compiles
    # a reference quantize fused into the decode for minutes).
    data, scale, amax = lax.optimization_barrier((data, scale, amax))
    return ref.dequantize_groups(data, scale, amax if amax.shape[0] else None, first_dims, last_dims, fmt, axis,
                                 x_shape, out_dtype, raw=raw)


# ---- CUDA and CPU lowerings (cpp/grouped/, cpp/cpu/) ----------------------------------------------------------
# One persistent launch per call: `jf4_grouped_quantize` (the per-group NVFP4 amax pass unless every amax is given,
# then the quantize; an extra float32[2N + 1] scratch result holds the per-group amaxes it encodes with and the
# kernel's scheduling counter, float32[1] without NVFP4) and
# `jf4_grouped_dequantize`. Group sizes stay on the device. The pairings one launch does not serve (MXFP8 rowwise
# with NVFP4 or the other MXFP8 columnwise) run two launches; on CUDA more than MAX_KERNEL_GROUPS groups run the
# reference (the CPU handlers keep their group table on the host: no limit). dbias is the reference's column sums
# (XLA ops).
FFI_TARGETS = ("jf4_grouped_quantize", "jf4_grouped_dequantize")
MAX_KERNEL_GROUPS = 1024  # cpp/grouped/group_table.cuh kMaxGroups (the group table lives in shared memory)
# jf4_grouped_quantize attributes: row_kind / col_kind and flags = row options | col options << COL_SHIFT, with the
# kinds and options of jf4_quantize (NVFP4 SR and RHT only); jf4_grouped_dequantize: kind and GroupedDequantizeFlag
# (jax_fp4/_src/ffi_codes.py).
_GROUPED_OPTIONS = (QuantizeOption.SR | QuantizeOption.RHT | QuantizeOption.USE_4OVER6 | QuantizeOption.E4M3_MAX_256
                    | QuantizeOption.ERR_MSE)


def quantize_flags(row_fmt, col_fmt, amax_given: int = 0) -> dict:
    """The `jf4_grouped_quantize` attributes of a format pairing (np.int32 values)."""
    opts = [ffi_codes.quantize_options(f, _GROUPED_OPTIONS) for f in (row_fmt, col_fmt)]
    return dict(row_kind=np.int32(ffi_codes.kind(row_fmt)), col_kind=np.int32(ffi_codes.kind(col_fmt)),
                flags=np.int32(opts[0] | (opts[1] << ffi_codes.COL_SHIFT)), amax_given=np.int32(amax_given))


def dequantize_flags(fmt, axis, raw) -> dict:
    """The `jf4_grouped_dequantize` attributes (np.int32 values)."""
    f = (GroupedDequantizeFlag.COLUMNWISE if axis == 0 else 0)
    f |= GroupedDequantizeFlag.RAW if raw and fmt.has_tensor_amax else 0
    f |= GroupedDequantizeFlag.RHT if fmt.rht else 0
    f |= GroupedDequantizeFlag.E4M3_MAX_256 if fmt.has_tensor_amax and fmt.global_e4m3_max == 256 else 0
    return dict(kind=np.int32(ffi_codes.kind(fmt)), flags=np.int32(f))


def _one_launch(row_fmt, col_fmt) -> bool:
    """Pairings one kernel launch serves (grouped_quantize_ffi.cu `Supported`)."""
    return row_fmt is None or col_fmt is None or isinstance(row_fmt, NVFP4) or row_fmt == col_fmt


def quantize_result_shapes(size, n, row_fmt, col_fmt) -> list:
    """ShapeDtypeStructs of the seven `jf4_grouped_quantize` results (the six outputs, then the amax scratch)."""
    avals = _orientation_avals(row_fmt, size, n) + _orientation_avals(col_fmt, size, n)
    nv = _tensor_scale(row_fmt) or _tensor_scale(col_fmt)
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals] + [
        jax.ShapeDtypeStruct((2 * n + 1 if nv else 1,), jnp.float32)]


def _kernel_quantize(x, first_dims, last_dims, key_row, key_col, amax_in, *, row_fmt, col_fmt, amax_given):
    """The six orientation outputs from `jf4_grouped_quantize` launches."""
    if not _one_launch(row_fmt, col_fmt):  # MXFP8 rowwise: its amax_given bit is 0
        args = (x, first_dims, last_dims, key_row, key_col, amax_in)
        row = _kernel_quantize(*args, row_fmt=row_fmt, col_fmt=None, amax_given=amax_given & 1)
        col = _kernel_quantize(*args, row_fmt=None, col_fmt=col_fmt, amax_given=amax_given & 2)
        return row[:3] + col[3:]
    if not amax_given:
        amax_in = jnp.zeros((0,), jnp.float32)
    shapes = quantize_result_shapes(math.prod(x.shape), first_dims.shape[0], row_fmt, col_fmt)
    outs = jax.ffi.ffi_call("jf4_grouped_quantize", shapes)(x, first_dims, last_dims, key_row, key_col, amax_in,
                                                             **quantize_flags(row_fmt, col_fmt, amax_given))
    return tuple(outs[:6])


def kernel_quantize(x, first_dims, last_dims, key_row, key_col, amax_in, *, row_fmt, col_fmt, representation, dbias,
                    amax_given, max_groups=None):
    """The FFI lowering's function (module docstring semantics; the reference beyond `max_groups` groups)."""
    params = dict(row_fmt=row_fmt, col_fmt=col_fmt, representation=representation, dbias=dbias,
                  amax_given=amax_given)
    if max_groups is not None and first_dims.shape[0] > max_groups:
        return reference_quantize(x, first_dims, last_dims, key_row, key_col, amax_in, **params)
    outs = _kernel_quantize(x, first_dims, last_dims, key_row, key_col, amax_in, row_fmt=row_fmt, col_fmt=col_fmt,
                            amax_given=amax_given)
    db = (ref.column_sums(x, first_dims, last_dims, representation) if dbias else jnp.zeros((0,), jnp.float32))
    return (*outs, db)


def kernel_dequantize(data, scale, amax, first_dims, last_dims, *, fmt, axis, x_shape, out_dtype, raw,
                      max_groups=None):
    """The FFI lowering's function of `jf4_grouped_dequantize` (the reference beyond `max_groups` groups)."""
    if max_groups is not None and first_dims.shape[0] > max_groups:
        return reference_dequantize(data, scale, amax, first_dims, last_dims, fmt=fmt, axis=axis, x_shape=x_shape,
                                    out_dtype=out_dtype, raw=raw)
    if raw or not _tensor_scale(fmt):
        amax = jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call("jf4_grouped_dequantize", jax.ShapeDtypeStruct(tuple(x_shape), out_dtype))
    return call(data, scale, amax, first_dims, last_dims, **dequantize_flags(fmt, axis, raw))


def _kernel_lowerings(max_groups, available):
    """The (quantize, dequantize) lowerings through the FFI targets, the reference beyond `max_groups` groups; (None,
    None) unless available."""
    if not available:
        return None, None
    q = functools.partial(kernel_quantize, max_groups=max_groups)
    dq = functools.partial(kernel_dequantize, max_groups=max_groups)
    return mlir.lower_fun(q, multiple_results=True), mlir.lower_fun(dq, multiple_results=False)


# Each through its sharding rule (partitioning_grouped.py; `local` is the per-shard bind's flag, consumed by the
# wrapper). The CPU handlers (cpp/cpu/grouped_*_cpu.cc) take the same operands, attributes and pairings, with no
# group limit; inside ffi.reference_lowering_on_cpu() the CPU lowers to the reference.
_cuda = _kernel_lowerings(MAX_KERNEL_GROUPS, _ffi.has_cuda_target(*FFI_TARGETS))
_cpu = _kernel_lowerings(None, _ffi.has_cpu_target(*FFI_TARGETS))
register_lowerings(grouped_quantize_p, partitioning_grouped.grouped_quantize,
                   mlir.lower_fun(reference_quantize, multiple_results=True), cuda=_cuda[0], cpu=_cpu[0])
register_lowerings(grouped_dequantize_p, partitioning_grouped.grouped_dequantize,
                   mlir.lower_fun(reference_dequantize, multiple_results=False), cuda=_cuda[1], cpu=_cpu[1])


# ---- batching: one unbatched call per example -------------------------------------------------------------------
def _is_fp4(dtype) -> bool:
    return jnp.dtype(dtype).name.startswith("float4")


def _mapped(prim, args, dims, params):
    """`lax.map` of the unbatched primitive. 4-bit arrays cross the loop boundary as uint8 codes: XLA:CPU (jax 0.12)
    emits invalid LLVM IR (an i8 -> i4 bitcast) for float4 values stacked by a while loop."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    lead = [jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
            for a, d in zip(args, dims, strict=True)]
    fp4_in = [_is_fp4(a.dtype) for a in lead]
    unbatched = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in lead]
    avals = jax.eval_shape(lambda *ops: prim.bind(*ops, **params), *unbatched)
    fp4_out = [_is_fp4(a.dtype) for a in (avals if prim.multiple_results else [avals])]
    lead = [codes.from_dtype(a).astype(jnp.uint8) if f else a for a, f in zip(lead, fp4_in, strict=True)]

    def body(ops):
        ops = [codes.to_dtype(a, jnp.float4_e2m1fn) if f else a for a, f in zip(ops, fp4_in, strict=True)]
        out = prim.bind(*ops, **params)
        outs = out if prim.multiple_results else [out]
        return [codes.from_dtype(o).astype(jnp.uint8) if f else o for o, f in zip(outs, fp4_out, strict=True)]

    outs = jax.lax.map(body, tuple(lead))
    outs = [codes.to_dtype(o, jnp.float4_e2m1fn) if f else o for o, f in zip(outs, fp4_out, strict=True)]
    return (outs, [0] * len(outs)) if prim.multiple_results else (outs[0], 0)


batching.primitive_batchers[grouped_quantize_p] = lambda args, dims, **p: _mapped(grouped_quantize_p, args, dims, p)
batching.primitive_batchers[grouped_dequantize_p] = (
    lambda args, dims, **p: _mapped(grouped_dequantize_p, args, dims, p))


# ---- binding helpers --------------------------------------------------------------------------------------------
def grouped_quantize_raw(x, first_dims, last_dims, key_row=None, key_col=None, *, row_fmt, col_fmt,
                         representation, dbias=False, row_amax=None, col_amax=None) -> dict:
    """Bind `jf4_grouped_quantize` (module docstring); key words default to zeros; row_amax / col_amax: float32[N]
    given NVFP4 amaxes of an orientation, or None to compute them. Returns the seven results by name."""
    n = first_dims.shape[0]
    zero = jnp.zeros((n, 2), jnp.uint32)
    key_row = zero if key_row is None else key_row
    key_col = zero if key_col is None else key_col
    given = (1 if row_amax is not None else 0) | (2 if col_amax is not None else 0)
    if given:
        fill = jnp.zeros((n,), jnp.float32)
        amax_in = jnp.concatenate([jnp.asarray(fill if a is None else a, jnp.float32).reshape(n)
                                   for a in (row_amax, col_amax)])
    else:
        amax_in = empty_operand(x)
    outs = grouped_quantize_p.bind(x, first_dims.astype(jnp.int32), last_dims.astype(jnp.int32), key_row, key_col,
                                   amax_in, row_fmt=row_fmt, col_fmt=col_fmt, representation=representation,
                                   dbias=bool(dbias), amax_given=given)
    return dict(zip(OUTPUT_NAMES, outs, strict=True))


def grouped_dequantize_raw(data, scale, amax, first_dims, last_dims, *, fmt, axis, x_shape, out_dtype=jnp.float32,
                           raw=False):
    """Bind `jf4_grouped_dequantize` (module docstring); amax None for formats without a tensor scale."""
    if amax is None or raw:
        amax = empty_operand(data)
    return grouped_dequantize_p.bind(data, scale, amax, first_dims.astype(jnp.int32), last_dims.astype(jnp.int32),
                                     fmt=fmt, axis=int(axis), x_shape=tuple(x_shape), out_dtype=jnp.dtype(out_dtype),
                                     raw=bool(raw))
