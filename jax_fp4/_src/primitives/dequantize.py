"""`jf4_dequantize`: NVFP4 / MXFP8 -> float32 / bfloat16 / float16 (docs/numerics.md sections 1-3).

Operands (`dequantize_array` views a QuantizedArray as [P, R, C]):
  data: NVFP4 float4_e2m1fn [P, R, C] (the stored layout, block axis C; packed two per byte on GPU, even index in
    the low nibble) | MXFP8 float8_e4m3fn / float8_e5m2 [P, R, C] (x's layout; blocks along C rowwise, along R
    with mx_columnwise).
  scale: compact: NVFP4 float8_e4m3fn [P, R, C/16]; MXFP8 float8_e8m0fnu [P, R, C/32] rowwise, [P, R/32, C]
    columnwise. Swizzled: the padded GEMM layout [round_up(rows, 128), round_up(cols, 4)] of the 2-D scale matrix
    [rows, cols] = [P*R, C/bs] (MXFP8 columnwise: [P*C, R/32], rows ordered (p, c)).
  amax: float32 [1] or [P] (NVFP4 1D/2D/RHT: the tensor amax, one per p once vmap folded a batch into P);
    float32 [0] for formats without a tensor scale. NVFP4 1D/2D/RHT with float32 [0]: block scales only, i.e.
    value(q) * s_b (then the inverse RHT if fmt.rht and inverse_rht) -- exact in bfloat16, the operand of the GEMM
    emulation, which applies the tensor scale after the product (`jax_fp4.gemm.exact_operand`).
  window_amax: float32 [P, R, C/64] (NVFP4 1x64), else float32 [0].
Static parameters: fmt, out_dtype (float32 / bfloat16 / float16), scale_layout ("compact" / "swizzled"),
  mx_columnwise (MXFP8 blocks along R), transpose_out (NVFP4 whose block axis is not x's last: the result is
  [P, C, R], x's own layout), inverse_rht (default True; False leaves an RHT tensor's values in the transformed
  domain: the GEMM emulation's operands, whose transforms cancel in the product), local (set by the sharding rule's
  per-shard body).
Result: out_dtype [P, R, C] ([P, C, R] with transpose_out), rounded once from fp32 (RNE, canonical NaN).

Constraints (abstract eval; `ValueError` naming the shapes, dtypes and format): data of rank 3 and the format's
data dtype; the block axis a whole number of blocks (1x64: of 64-windows); scale of the format's scale dtype and
the shape above; amax / window_amax as above; mx_columnwise only for MXFP8, transpose_out only for NVFP4.

Lowerings: CUDA FFI target `jf4_dequantize` (cpp/dequantize/) when the extension is built, on the CPU the host
handler of that name (cpp/cpu/) when the CPU extension is built, the bit-exact reference
(`jax_fp4.reference.nvfp4.dequantize` / `mxfp8.dequantize`) elsewhere. vmap folds the batch into P
(swizzled scales are unswizzled first by `jf4_unswizzle`), so batched calls run the kernel too. Sharding:
partitioning.py. Autodiff: stop_gradient semantics (a symbolic-zero tangent for every operand), as the reference's
integer-exact arithmetic had; quantized training differentiates through the recipes' custom_vjp instead.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_fp4._src import ffi as _ffi
from jax_fp4._src.ffi_codes import DequantizeFlag
from jax_fp4._src.primitives import partitioning
from jax_fp4._src.primitives._common import def_impl, empty_operand
from jax_fp4._src.primitives.partitioning_base import register_lowerings
from jax_fp4._src.primitives.swizzle import padded_shape, unswizzle_p
from jax_fp4.formats import MXFP8, NVFP4
from jax_fp4.quantized_array import SCALE_LAYOUTS
from jax_fp4.reference import codes, layout, mxfp8, nvfp4, rht

__all__ = ["dequantize_p", "dequantize_3d", "dequantize_array", "dequantize_operands", "block_scaled_values",
           "OUT_DTYPES"]

#: Output dtypes.
OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

dequantize_p = Primitive("jf4_dequantize")
def_impl(dequantize_p)


def scale_matrix_shape(fmt, shape, mx_columnwise) -> tuple[int, int]:
    """[rows, cols] of the 2-D scale matrix of data [P, R, C]."""
    P, R, C = shape
    bs = fmt.block_size
    return (P * C, R // bs) if mx_columnwise else (P * R, C // bs)


def compact_scale_shape(fmt, shape, mx_columnwise) -> tuple[int, int, int]:
    P, R, C = shape
    bs = fmt.block_size
    return (P, R // bs, C) if mx_columnwise else (P, R, C // bs)


def _check_operand(where, name, a, shape, dtype):
    if tuple(a.shape) != tuple(shape) or jnp.dtype(a.dtype) != jnp.dtype(dtype):
        raise ValueError(f"{where}: {name} must be {jnp.dtype(dtype).name}{list(shape)}, got "
                         f"{jnp.dtype(a.dtype).name}{list(a.shape)}")


def _abstract_eval(data, scale, amax, window_amax, *, fmt, out_dtype, scale_layout, mx_columnwise, transpose_out,
                   inverse_rht=True, local=False):
    where = f"jf4_dequantize: data {jnp.dtype(data.dtype).name}{list(data.shape)} ({fmt!r})"
    if not isinstance(fmt, (NVFP4, MXFP8)):
        raise ValueError(f"{where}: expected a jax_fp4 format, got {fmt!r}")
    if len(data.shape) != 3:
        raise ValueError(f"{where}: expected rank 3 [P, R, C]")
    if jnp.dtype(data.dtype) != jnp.dtype(fmt.data_dtype):
        raise ValueError(f"{where}: data must be {jnp.dtype(fmt.data_dtype).name}")
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"{where}: output dtype must be float32, bfloat16 or float16, got {out_dtype}")
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"{where}: scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
    if mx_columnwise and fmt.stores_block_axis_last:
        raise ValueError(f"{where}: mx_columnwise is for MXFP8 (NVFP4 stores its block axis last)")
    if transpose_out and not fmt.stores_block_axis_last:
        raise ValueError(f"{where}: transpose_out is for NVFP4 (MXFP8 keeps x's layout)")
    P, R, C = data.shape
    blocked = R if mx_columnwise else C
    if blocked % fmt.block_size or (fmt.local_1x64 and C % fmt.window_size):
        raise ValueError(f"{where}: the block axis ({'R' if mx_columnwise else 'C'} = {blocked}) is not a whole "
                         f"number of {fmt.window_size if fmt.local_1x64 else fmt.block_size}-blocks")
    if scale_layout == "swizzled":
        expect = padded_shape(*scale_matrix_shape(fmt, data.shape, mx_columnwise))
    else:
        expect = compact_scale_shape(fmt, data.shape, mx_columnwise)
    _check_operand(where, f"scale ({scale_layout})", scale, expect, fmt.scale_dtype)
    if fmt.has_tensor_amax:
        if tuple(amax.shape) not in ((1,), (P,), (0,)) or amax.dtype != jnp.float32:
            raise ValueError(f"{where}: amax must be float32[1] or float32[{P}] (or float32[0]: block scales only), "
                             f"got {amax.dtype}{list(amax.shape)}")
    else:
        _check_operand(where, "amax (unused by this format)", amax, (0,), jnp.float32)
    w_shape = (P, R, C // fmt.window_size) if fmt.local_1x64 else (0,)
    _check_operand(where, "window_amax", window_amax, w_shape, jnp.float32)
    return jax.core.ShapedArray((P, C, R) if transpose_out else (P, R, C), jnp.dtype(out_dtype))


dequantize_p.def_abstract_eval(_abstract_eval)


# ---- reference lowering -----------------------------------------------------------------------------------------
def _compact_from_swizzled(fmt, scale, shape, mx_columnwise):
    """The swizzled padded scale matrix -> compact [P, ...] scales (`compact_scale_shape`)."""
    P, R, C = shape
    m = layout.unswizzle(scale, *scale_matrix_shape(fmt, shape, mx_columnwise))
    if mx_columnwise:
        return jnp.swapaxes(m.reshape(P, C, R // fmt.block_size), 1, 2)
    return m.reshape(compact_scale_shape(fmt, shape, mx_columnwise))


def reference_dequantize(data, scale, amax, window_amax, *, fmt, out_dtype, scale_layout, mx_columnwise,
                         transpose_out, inverse_rht=True):
    """The primitive's semantics in pure jnp (its default lowering)."""
    # A barrier between the codes and their decode: without it XLA fuses a producer's integer chains (e.g. the
    # reference quantize in the same jit) into the decode, and jax >= 0.11's algebraic simplifier then takes minutes.
    data, scale, amax, window_amax = lax.optimization_barrier((data, scale, amax, window_amax))
    if scale_layout == "swizzled":
        scale = _compact_from_swizzled(fmt, scale, data.shape, mx_columnwise)
    if fmt.has_tensor_amax and amax.shape[0] == 0:  # block scales only (see the module docstring)
        bs = fmt.block_size
        v = codes.e2m1_value(codes.from_dtype(data))
        v = (v.reshape(*v.shape[:-1], v.shape[-1] // bs, bs) * scale.astype(jnp.float32)[..., None]).reshape(v.shape)
        v = rht.inverse(v) if fmt.rht and inverse_rht else v
    elif isinstance(fmt, NVFP4):
        a = None
        if fmt.has_tensor_amax:
            a = amax[0] if amax.shape[0] == 1 else amax[:, None, None]
        w = window_amax if fmt.local_1x64 else None
        v = nvfp4.dequantize(codes.from_dtype(data), codes.from_dtype(scale), a, w, fmt, inverse_rht)
    elif mx_columnwise:
        v = jnp.swapaxes(mxfp8.dequantize(jnp.swapaxes(data, 1, 2), codes.from_dtype(jnp.swapaxes(scale, 1, 2)),
                                          fmt, out_dtype), 1, 2)
    else:
        v = mxfp8.dequantize(data, codes.from_dtype(scale), fmt, out_dtype)
    if transpose_out:
        v = jnp.swapaxes(v, 1, 2)
    return codes.output(v, out_dtype)


_reference_lowering = mlir.lower_fun(reference_dequantize, multiple_results=False)


# ---- CUDA lowering ----------------------------------------------------------------------------------------------
def kind(fmt) -> int:
    """The `jf4_dequantize` kind attribute (jax_fp4/_src/ffi_codes.py Kind)."""
    return fmt.kind_code


def flags(fmt, scale_layout, mx_columnwise, transpose_out, inverse_rht=True) -> int:
    """The `jf4_dequantize` flags attribute (jax_fp4/_src/ffi_codes.py DequantizeFlag)."""
    f = DequantizeFlag.SWIZZLED if scale_layout == "swizzled" else 0
    f |= DequantizeFlag.MX_COLUMNWISE if mx_columnwise else 0
    f |= DequantizeFlag.TRANSPOSE_OUT if transpose_out else 0
    f |= (DequantizeFlag.RHT if fmt.rht and inverse_rht else 0) | (DequantizeFlag.LOCAL_1X64 if fmt.local_1x64 else 0)
    f |= DequantizeFlag.E4M3_MAX_256 if fmt.has_tensor_amax and fmt.global_e4m3_max == 256 else 0
    return int(f)


def _cuda_lowering(ctx, data, scale, amax, window_amax, **params):
    if math.prod(ctx.avals_in[0].shape) >= 2**40:  # beyond the kernel's 2^31-block grid
        return _reference_lowering(ctx, data, scale, amax, window_amax, **params)
    fmt = params["fmt"]
    f = flags(fmt, params["scale_layout"], params["mx_columnwise"], params["transpose_out"],
              params.get("inverse_rht", True))  # a bind without it (the default) applies the inverse RHT
    return jax.ffi.ffi_lowering("jf4_dequantize")(ctx, data, scale, amax, window_amax, kind=np.int32(kind(fmt)),
                                                  flags=np.int32(f))


register_lowerings(dequantize_p, partitioning.dequantize, _reference_lowering,
                   cuda=_cuda_lowering if _ffi.has_cuda_target("jf4_dequantize") else None,
                   cpu=_cuda_lowering if _ffi.has_cpu_target("jf4_dequantize") else None)  # the host handler


# ---- batching: fold the batch into P ----------------------------------------------------------------------------
def _batch_rule(args, dims, *, fmt, out_dtype, scale_layout, mx_columnwise, transpose_out, inverse_rht=True,
                local=False):
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)

    def lead(a, d):
        return jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)

    data, scale, amax, window_amax = (lead(a, d) for a, d in zip(args, dims, strict=True))
    B, (P, R, C) = size, data.shape[1:]
    if scale_layout == "swizzled":  # batched unswizzle (kernel), then the compact layout per example
        rows, cols = scale_matrix_shape(fmt, (P, R, C), mx_columnwise)
        m = unswizzle_p.bind(scale, rows=rows, cols=cols)
        if mx_columnwise:
            scale = jnp.swapaxes(m.reshape(B, P, C, R // fmt.block_size), 2, 3)
        else:
            scale = m.reshape(B, *compact_scale_shape(fmt, (P, R, C), mx_columnwise))
    if fmt.has_tensor_amax and amax.shape[-1] != 0:  # [B, 1] or [B, P] -> one amax per folded p
        amax = jnp.broadcast_to(amax, (B, P)).reshape(B * P)
    else:
        amax = empty_operand(data)
    if fmt.local_1x64:
        window_amax = window_amax.reshape(B * P, *window_amax.shape[2:])
    else:
        window_amax = empty_operand(data)
    out = dequantize_p.bind(data.reshape(B * P, R, C), scale.reshape(B * P, *scale.shape[2:]), amax, window_amax,
                            fmt=fmt, out_dtype=out_dtype, scale_layout="compact", mx_columnwise=mx_columnwise,
                            transpose_out=transpose_out, inverse_rht=inverse_rht)
    return out.reshape(B, P, *out.shape[1:]), 0


batching.primitive_batchers[dequantize_p] = _batch_rule
ad.defjvp(dequantize_p, None, None, None, None)  # zero tangents (see the module docstring)


def _amax_operand(amax, data):
    if amax is None:
        return empty_operand(data)
    amax = jnp.asarray(amax, jnp.float32)
    return amax.reshape(1) if amax.ndim == 0 else amax


def dequantize_3d(data, scale, amax, window_amax, *, fmt, out_dtype, scale_layout="compact", mx_columnwise=False,
                  transpose_out=False, inverse_rht=True, block_scales_only=False):
    """Bind the primitive (see the module docstring). amax: None, a scalar, or float32[1] / [P]; window_amax:
    None or float32[P, R, C/64]. block_scales_only (NVFP4 1D/2D/RHT, amax None): value(q) * s_b, the GEMM
    emulation's operand; without it a missing NVFP4 tensor amax is a ValueError, never a silent omission."""
    if fmt.has_tensor_amax and (amax is None) != bool(block_scales_only):
        raise ValueError(f"jf4_dequantize ({fmt!r}): amax must be float32[1] or float32[P] (the tensor amax), or None "
                         f"with block_scales_only=True; got amax={'None' if amax is None else 'an array'}, "
                         f"block_scales_only={block_scales_only}")
    window_amax = empty_operand(data) if window_amax is None else window_amax
    return dequantize_p.bind(data, scale, _amax_operand(amax, data), window_amax, fmt=fmt,
                             out_dtype=jnp.dtype(out_dtype), scale_layout=scale_layout,
                             mx_columnwise=bool(mx_columnwise), transpose_out=bool(transpose_out),
                             inverse_rht=bool(inverse_rht))


def dequantize_operands(q, dtype=jnp.float32, *, inverse_rht: bool = True):
    """(operands, params) of the `jf4_dequantize` bind for a QuantizedArray q: its [P, R, C] view.

    inverse_rht=False leaves an RHT tensor's values in the transformed domain (the primitive's inverse_rht).

    View: with a = q.axis and x's shape (lead, n, trail): rowwise (a last) [1, prod(lead), n]; NVFP4 otherwise
    [prod(lead), prod(trail), n] with transpose_out (the data stores x[p].T); MXFP8 otherwise
    [prod(lead), n, prod(trail)] with mx_columnwise. Swizzled scales are passed as they are.
    """
    fmt, shape = q.fmt, q.shape
    nd = len(shape)
    a = q.axis % nd
    n = shape[a]
    P, T = math.prod(shape[:a]), math.prod(shape[a + 1:])
    if a == nd - 1:  # rowwise: [1, rows, n]
        P, R, C, transpose, mx_col = 1, P, n, False, False
    elif fmt.stores_block_axis_last:  # NVFP4: stored [lead, trail, n]; x is its per-lead transpose
        R, C, transpose, mx_col = T, n, True, False
    else:  # MXFP8 keeps x's layout; blocks along R
        R, C, transpose, mx_col = n, T, False, True
    data = q.data.reshape(P, R, C)
    if q.scale_layout == "swizzled":
        scale = q.scale
    else:
        scale = q.scale.reshape(compact_scale_shape(fmt, (P, R, C), mx_col))
    amax = _amax_operand(q.amax if fmt.has_tensor_amax else None, data)
    if fmt.local_1x64:
        w = q.window_amax.reshape(P, R, C // fmt.window_size)
    else:
        w = empty_operand(data)
    params = dict(fmt=fmt, out_dtype=jnp.dtype(dtype), scale_layout=q.scale_layout, mx_columnwise=mx_col,
                  transpose_out=transpose, inverse_rht=bool(inverse_rht))
    return (data, scale, amax, w), params


def block_scaled_values(q, dtype=jnp.bfloat16):
    """value(q) * block scale of a QuantizedArray with a tensor amax (NVFP4 1D/2D/RHT), in q.shape and `dtype`:
    the tensor scale and the inverse RHT left out (the emulated GEMM's operand; exact in bfloat16). One
    `jf4_dequantize` bind in its block-scales-only mode (an empty amax operand)."""
    if not q.fmt.has_tensor_amax:
        raise ValueError(f"block_scaled_values: {q!r} has no tensor amax (NVFP4 1D/2D/RHT only)")
    (data, scale, _, _), params = dequantize_operands(q, dtype, inverse_rht=False)
    return dequantize_3d(data, scale, None, None, block_scales_only=True, **params).reshape(q.shape)


def dequantize_array(q, dtype=jnp.float32, *, inverse_rht: bool = True):
    """A QuantizedArray -> `dtype` array of its logical shape (q.shape) through `jf4_dequantize`
    (`dequantize_operands` gives the view; inverse_rht=False: an RHT tensor's values in the transformed domain)."""
    args, params = dequantize_operands(q, dtype, inverse_rht=inverse_rht)
    return dequantize_p.bind(*args, **params).reshape(q.shape)
