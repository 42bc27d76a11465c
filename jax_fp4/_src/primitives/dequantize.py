"""`jf4_dequantize`: NVFP4 / MXFP8 -> float32 / bfloat16 / float16 (NUMERICS.md sections 1-3).

Operands (the ops layer reshapes a QuantizedArray into this [P, R, C] view, see `dequantize_3d`):
  data: NVFP4 float4_e2m1fn [P, R, C] (stored layout, block axis C) | MXFP8 float8 [P, R, C] (x's layout, blocks
    along C rowwise or along R columnwise);
  scale: compact (NVFP4 [P, R, C/16]; MXFP8 rowwise [P, R, C/32], columnwise [P, R/32, C]) or swizzled (the padded
    2-D GEMM layout of the scale matrix);
  amax: float32[1] (NVFP4 1D/2D/RHT) or float32[0]; window_amax: float32[P, R, C/64] (NVFP4 1x64) or float32[0].
Static parameters: fmt, out_dtype, scale_layout, mx_columnwise (MXFP8 blocks along R), transpose_out (NVFP4 whose
  block axis is not x's last: the result is [P, C, R], x's own layout).
Result: out_dtype [P, R, C] (or [P, C, R]).

Lowerings: CUDA FFI target `jf4_dequantize` (cpp/dequantize/) where the kernel tiles the case (C % 16 == 0), the
reference elsewhere. The public `jax_fp4.dequantize` switches to this primitive once the kernel has been verified
bit-exact on a GPU (it is compiled and CPU-tested through the reference lowering, not yet run on a GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_fp4._src import ffi as _ffi
from jax_fp4._src.primitives._common import def_impl
from jax_fp4.formats import NVFP4, round_up
from jax_fp4.reference import codes, layout, mxfp8, nvfp4

__all__ = ["dequantize_p", "dequantize_3d"]

KIND_NVFP4, KIND_MXFP8_E4M3, KIND_MXFP8_E5M2 = 1, 2, 3
OPT_RHT, OPT_1X64, OPT_SWIZZLED, OPT_TRANSPOSE, OPT_MX_COL = 2, 8, 1 << 16, 1 << 17, 1 << 18
_OUT = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

dequantize_p = Primitive("jf4_dequantize")
def_impl(dequantize_p)


def _scale_matrix_shape(fmt, shape, mx_columnwise):
    P, R, C = shape
    bs = fmt.block_size
    return (P * C, R // bs) if mx_columnwise else (P * R, C // bs)


def _abstract_eval(data, scale, amax, window_amax, *, fmt, out_dtype, scale_layout, mx_columnwise, transpose_out):
    where = f"jf4_dequantize: data {data.dtype}{list(data.shape)} ({fmt!r})"
    if data.ndim != 3:
        raise ValueError(f"{where}: expected rank 3 [P, R, C]")
    if jnp.dtype(out_dtype) not in _OUT:
        raise ValueError(f"{where}: output dtype must be float32, bfloat16 or float16, got {out_dtype}")
    P, R, C = data.shape
    bs = fmt.block_size
    blocked = R if mx_columnwise else C
    if blocked % bs or (isinstance(fmt, NVFP4) and fmt.local_1x64 and C % fmt.window_size):
        raise ValueError(f"{where}: the block axis is not a whole number of blocks")
    rows, cols = _scale_matrix_shape(fmt, data.shape, mx_columnwise)
    if scale_layout == "swizzled":
        expect = (round_up(rows, 128), round_up(cols, 4))
    elif isinstance(fmt, NVFP4):
        expect = (P, R, C // bs)
    else:
        expect = (P, R // bs, C) if mx_columnwise else (P, R, C // bs)
    if tuple(scale.shape) != expect:
        raise ValueError(f"{where}: scale shape {tuple(scale.shape)} != {expect} ({scale_layout})")
    out = (P, C, R) if transpose_out else (P, R, C)
    return jax.core.ShapedArray(out, jnp.dtype(out_dtype))


dequantize_p.def_abstract_eval(_abstract_eval)


def _reference(data, scale, amax, window_amax, *, fmt, out_dtype, scale_layout, mx_columnwise, transpose_out):
    P, R, C = data.shape
    if scale_layout == "swizzled":
        rows, cols = _scale_matrix_shape(fmt, data.shape, mx_columnwise)
        m = layout.unswizzle(scale, rows, cols)
        scale = m.reshape(P, C, R // fmt.block_size) if mx_columnwise else m.reshape(P, R, -1)
        if mx_columnwise:
            scale = jnp.swapaxes(scale, 1, 2)
    if isinstance(fmt, NVFP4):
        w = window_amax.reshape(P, R, -1) if fmt.local_1x64 else None
        v = nvfp4.dequantize(codes.from_dtype(data), codes.from_dtype(scale), amax[0] if amax.size else None, w, fmt)
    elif mx_columnwise:
        v = jnp.swapaxes(mxfp8.dequantize(jnp.swapaxes(data, 1, 2), codes.from_dtype(jnp.swapaxes(scale, 1, 2)),
                                          fmt), 1, 2)
    else:
        v = mxfp8.dequantize(data, codes.from_dtype(scale), fmt)
    if transpose_out:
        v = jnp.swapaxes(v, 1, 2)
    return codes.output(v, out_dtype)


_reference_lowering = mlir.lower_fun(_reference, multiple_results=False)
mlir.register_lowering(dequantize_p, _reference_lowering)


def _flags(fmt, scale_layout, mx_columnwise, transpose_out):
    f = OPT_SWIZZLED if scale_layout == "swizzled" else 0
    f |= OPT_MX_COL if mx_columnwise else 0
    f |= OPT_TRANSPOSE if transpose_out else 0
    if isinstance(fmt, NVFP4):
        f |= (OPT_RHT if fmt.rht else 0) | (OPT_1X64 if fmt.local_1x64 else 0)
    return f


def _cuda_lowering(ctx, data, scale, amax, window_amax, **params):
    P, R, C = ctx.avals_in[0].shape
    if C % 16 or P > 65535:
        return _reference_lowering(ctx, data, scale, amax, window_amax, **params)
    fmt = params["fmt"]
    kind = KIND_NVFP4 if isinstance(fmt, NVFP4) else (KIND_MXFP8_E4M3 if fmt.element == "e4m3" else KIND_MXFP8_E5M2)
    flags = _flags(fmt, params["scale_layout"], params["mx_columnwise"], params["transpose_out"])
    return jax.ffi.ffi_lowering("jf4_dequantize")(ctx, data, scale, amax, window_amax, kind=np.int32(kind),
                                                  flags=np.int32(flags))


if _ffi.ensure_registered() and "jf4_dequantize" in _ffi.targets():
    mlir.register_lowering(dequantize_p, _cuda_lowering, platform="cuda")


def _batch_rule(args, dims, **params):
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    moved = [jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
             for a, d in zip(args, dims, strict=True)]
    return jax.vmap(lambda *a: _reference(*a, **params))(*moved), 0


batching.primitive_batchers[dequantize_p] = _batch_rule


def dequantize_3d(data, scale, amax, window_amax, *, fmt, out_dtype, scale_layout="compact", mx_columnwise=False,
                  transpose_out=False):
    """Bind the primitive (see the module docstring)."""
    amax = jnp.zeros((0,), jnp.float32) if amax is None else jnp.reshape(amax, (1,)).astype(jnp.float32)
    window_amax = jnp.zeros((0,), jnp.float32) if window_amax is None else window_amax
    return dequantize_p.bind(data, scale, amax, window_amax, fmt=fmt, out_dtype=jnp.dtype(out_dtype),
                             scale_layout=scale_layout, mx_columnwise=bool(mx_columnwise),
                             transpose_out=bool(transpose_out))


def dequantize_array(q, dtype=jnp.float32):
    """A QuantizedArray -> `dtype` array of its logical shape through `jf4_dequantize` ([P, R, C] view)."""
    fmt, shape, nd = q.fmt, q.shape, len(q.shape)
    a = q.axis % nd
    lead, blocked, trail = shape[:a], shape[a], shape[a + 1:]
    P, T = int(np.prod(lead, dtype=np.int64)), int(np.prod(trail, dtype=np.int64))
    if a == nd - 1:  # rowwise: [1, rows, n]
        P, R, C, transpose, mx_col = 1, P, blocked, False, False
    elif isinstance(fmt, NVFP4):  # stored [lead, trail, n]; x is its per-lead transpose
        R, C, transpose, mx_col = T, blocked, True, False
    else:  # MXFP8 keeps x's layout; blocks along R
        R, C, transpose, mx_col = blocked, T, False, True
    data = q.data.reshape(P, R, C)
    if q.scale_layout == "swizzled":
        scale = q.scale
    elif isinstance(fmt, NVFP4) or not mx_col:
        scale = q.scale.reshape(P, R, C // fmt.block_size)
    else:
        scale = q.scale.reshape(P, R // fmt.block_size, C)
    w = q.window_amax.reshape(-1) if q.window_amax is not None else None
    out = dequantize_3d(data, scale, q.amax, w, fmt=fmt, out_dtype=dtype, scale_layout=q.scale_layout,
                        mx_columnwise=mx_col, transpose_out=transpose)
    return out.reshape(shape)
