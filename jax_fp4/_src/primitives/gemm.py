"""`jf4_gemm`: the block-scaled GEMM of two K-major quantized operands (docs/numerics.md section 7).

  out[m, n] = cast(ta * tb * sum_k a[m, k] * b[n, k] + bias[n]),  out_amax = max |out|

Operands (in this order; row-major, the contracting axis K last for both, "TN"):
  a_data  [M, K]  float4_e2m1fn (NVFP4; packed two per byte on GPU, element 2j in the low nibble) or
                  float8_e4m3fn / float8_e5m2 (MXFP8)
  a_scale [M, K/16] float8_e4m3fn (NVFP4) or [M, K/32] float8_e8m0fnu (MXFP8): compact block scales
  a_aux   float32: NVFP4 with a tensor amax (1D / 2D / RHT): the tensor amax, shape []; NVFP4 1x64: the window amax
          [M, K/64]; MXFP8: shape [0]
  b_data, b_scale, b_aux: the same for B [N, K]
  bias    float32 [N], or float32 [0] for none
Static parameters: a_fmt, b_fmt (the operands' `jax_fp4` formats), out_dtype (float32 or bfloat16), emit_amax.
Results: out [M, N] out_dtype; out_amax float32 [] (max |out| after the bias and the cast, NaN when an output is
NaN, as jnp.max(jnp.abs(out)); 0 when emit_amax is False, which the callers then ignore).

Semantics: exactly the emulated product (`exact_dot_general`): a[m, k] = value(code) * block scale (exact in
bfloat16) for NVFP4 1D/2D/RHT (the RHT left in place: it cancels in the product of an RHT pair) and MXFP8, the
dequantized float32 value for NVFP4 1x64; the products accumulate in float32; the NVFP4 tensor scales
ta = decode_amax(amax) * fp32(1/2688) (`reference.nvfp4.tensor_decode_scale`) multiply the float32 sum, a's
first; the bias is added in float32; one cast to out_dtype. Callers pass decode_amax(amax) as a_aux (identical
for every amax >= 7.9e-36 and for 0 / NaN / inf), so the kernel's fp32(amax) * fp32(1/2688) is the same scale.

Constraints (abstract eval; `ValueError` naming the operand, its shape / dtype and the format): rank-2 data of the
format's data dtype; equal K; K a whole number of blocks (of 64-windows for 1x64); scales, aux and bias of the
shapes above; 1x64 operands pair only with 1x64 operands (the kernel's window promotion needs both); out_dtype
float32 or bfloat16.

Lowerings: CUDA FFI target `jf4_gemm` (cpp/gemm/, sm_90a WGMMA: the codes and block scales are decoded to bfloat16
on chip, 1x64 window partial sums promoted with the two window decode factors; attributes a_kind, b_kind
(`ffi_codes.Kind`), flags (`ffi_codes.GemmFlag`)) when the CUDA extension provides it; every other platform (and
CUDA without it) lowers to the emulation above (`mlir.lower_fun`), so results on the CPU are bit for bit those of
`exact_dot_general`. The kernel's float32 accumulation order is its own: GPU results are compared against bounds.
vmap: a batched A with a shared B (and no tensor amax or amax output per example) is folded into M; any other
batching runs the primitive once per example (`lax.map`). Sharding (partitioning_gemm.py): M and N parallel as the
rows of a and b are sharded, K gathered. Not differentiable (the custom VJPs of
`jax_fp4.dense` differentiate the quantized GEMMs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_fp4._src import ffi as _ffi
from jax_fp4._src.emulation.product import cpu_float32_operands, exact_product  # noqa: F401 - re-exported
from jax_fp4._src.ffi_codes import GemmFlag
from jax_fp4._src.primitives import partitioning_gemm
from jax_fp4._src.primitives._common import def_impl, empty_operand
from jax_fp4._src.primitives.dequantize import block_scaled_values, dequantize_array
from jax_fp4._src.primitives.partitioning_base import register_lowerings
from jax_fp4.formats import Format
from jax_fp4.quantized_array import QuantizedArray
from jax_fp4.reference.nvfp4 import tensor_decode_scale

__all__ = ["FFI_TARGET", "OUT_DTYPES", "TN", "gemm_p", "gemm", "aux_shape", "exact_operand", "exact_product",
           "cpu_float32_operands",
           "ffi_attributes", "kernel_formats_ok"]

FFI_TARGET = "jf4_gemm"
#: Output dtypes of the primitive (the kernel writes them directly).
OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
#: dimension numbers of a[M, K] . b[N, K] -> [M, N]
TN = (((1,), (1,)), ((), ()))

gemm_p = Primitive("jf4_gemm")
gemm_p.multiple_results = True
def_impl(gemm_p)


# ---- the emulated product's operands (the product itself: jax_fp4/_src/emulation/product.py) ----------------
def exact_operand(q: QuantizedArray):
    """(values, tensor_scale): values in q.shape's orientation with dequantize(q) == values * tensor_scale.

    values: bfloat16 holding value(q) * block scale exactly (NVFP4 1D/2D/RHT: the RHT is left in place, it cancels
    in the product of two RHT operands; MXFP8), or the float32 dequantized values (NVFP4 1x64); tensor_scale:
    float32 scalar amax * fp32(1/2688) (NVFP4 with a tensor amax) or None. Computed by `jf4_dequantize` (the CUDA
    kernel on GPU, the reference elsewhere; NVFP4 through its block-scales-only mode, an empty amax operand).
    """
    if not q.fmt.exact_operand_ok:  # NVFP4 1x64: the window scales do not factor out of the sum
        return dequantize_array(q, jnp.float32), None
    if q.fmt.has_tensor_amax:
        return block_scaled_values(q), tensor_decode_scale(q.amax, q.fmt.global_e4m3_max)
    return dequantize_array(q, jnp.bfloat16), None


# ---- abstract evaluation ----------------------------------------------------------------------------------------
def kernel_formats_ok(fa, fb) -> bool:
    """Whether the kernel takes a pair of formats: any NVFP4 (1D / 2D / RHT) / MXFP8 E4M3 / E5M2 pairing, or NVFP4
    1x64 with NVFP4 1x64 (the window promotion needs both operands windowed); no 4over6 operand."""
    if not (isinstance(fa, Format) and isinstance(fb, Format)):
        return False
    if fa.use_4over6 or fb.use_4over6:  # the kernel's tensor scale is amax * fp32(1/2688) (the 448 bound) only
        return False
    return fa.local_1x64 == fb.local_1x64


def aux_shape(fmt, rows: int, k: int) -> tuple[int, ...]:
    """The aux operand's shape: [rows, K/64] (1x64 window amax), [] (NVFP4 tensor amax) or [0] (MXFP8)."""
    if fmt.local_1x64:
        return (rows, k // fmt.window_size)
    return () if fmt.has_tensor_amax else (0,)


def _desc(a) -> str:
    return f"{jnp.dtype(a.dtype).name}{list(a.shape)}"


def _check_operand(side, data, scale, aux, fmt, k):
    where = f"jf4_gemm: {side}"
    if not isinstance(fmt, Format):
        raise ValueError(f"{where}: expected a jax_fp4 format, got {fmt!r}")
    if len(data.shape) != 2 or jnp.dtype(data.dtype) != jnp.dtype(fmt.data_dtype):
        raise ValueError(f"{where}_data must be {jnp.dtype(fmt.data_dtype).name}[rows, K] ({fmt!r}, K-major), got "
                         f"{_desc(data)}")
    rows = data.shape[0]
    unit = fmt.window_size if fmt.local_1x64 else fmt.block_size
    if k % unit:
        raise ValueError(f"{where}_data {_desc(data)}: K = {k} is not a multiple of {unit} ({fmt!r})")
    want = (rows, k // fmt.block_size)
    if tuple(scale.shape) != want or jnp.dtype(scale.dtype) != jnp.dtype(fmt.scale_dtype):
        raise ValueError(f"{where}_scale must be the compact block scales {jnp.dtype(fmt.scale_dtype).name}"
                         f"{list(want)} of {side}_data {_desc(data)} ({fmt!r}), got {_desc(scale)}")
    want = aux_shape(fmt, rows, k)
    if tuple(aux.shape) != want or jnp.dtype(aux.dtype) != jnp.float32:
        what = ("the 1x64 window amax" if fmt.local_1x64 else "the tensor amax" if fmt.has_tensor_amax
                else "empty: no tensor scale")
        raise ValueError(f"{where}_aux must be float32{list(want)} ({what}, {fmt!r}), got {_desc(aux)}")


def _abstract_eval(a_data, a_scale, a_aux, b_data, b_scale, b_aux, bias, *, a_fmt, b_fmt, out_dtype, emit_amax,
                   local=False):
    if len(a_data.shape) != 2 or len(b_data.shape) != 2:
        raise ValueError(f"jf4_gemm: a_data {_desc(a_data)} and b_data {_desc(b_data)} must be rank 2 ([M, K] and "
                         "[N, K], K-major)")
    k = a_data.shape[1]
    if b_data.shape[1] != k:
        raise ValueError(f"jf4_gemm: the contracting lengths differ: a_data {_desc(a_data)} vs b_data "
                         f"{_desc(b_data)} (both [rows, K])")
    _check_operand("a", a_data, a_scale, a_aux, a_fmt, k)
    _check_operand("b", b_data, b_scale, b_aux, b_fmt, k)
    if not kernel_formats_ok(a_fmt, b_fmt):
        raise ValueError(f"jf4_gemm: NVFP4 1x64 operands pair only with NVFP4 1x64 operands, got {a_fmt!r} x "
                         f"{b_fmt!r}")
    n = b_data.shape[0]
    if tuple(bias.shape) not in ((n,), (0,)) or jnp.dtype(bias.dtype) != jnp.float32:
        raise ValueError(f"jf4_gemm: bias must be float32[{n}] (N of b_data {_desc(b_data)}) or float32[0] (none), "
                         f"got {_desc(bias)}")
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"jf4_gemm: out_dtype must be float32 or bfloat16, got {jnp.dtype(out_dtype).name}")
    return (jax.core.ShapedArray((a_data.shape[0], n), jnp.dtype(out_dtype)), jax.core.ShapedArray((), jnp.float32))


gemm_p.def_abstract_eval(_abstract_eval)


# ---- the emulated lowering (every platform without the kernel) ---------------------------------------------------
def _quantized(data, scale, aux, fmt):
    amax = aux if fmt.has_tensor_amax else None
    window = aux if fmt.local_1x64 else None
    return QuantizedArray(data, scale, amax, window, fmt=fmt, axis=-1)


def emulated_gemm(a_data, a_scale, a_aux, b_data, b_scale, b_aux, bias, *, a_fmt, b_fmt, out_dtype, emit_amax):
    """The primitive's semantics in jnp: `exact_dot_general` of the two operands (its optimization barriers
    included), the bias, the cast, the amax."""
    ops = [exact_operand(lax.optimization_barrier(_quantized(d, s, x, f)))
           for d, s, x, f in ((a_data, a_scale, a_aux, a_fmt), (b_data, b_scale, b_aux, b_fmt))]
    out = exact_product(ops, TN)
    if bias.shape[0]:
        out = out + bias
    out = out.astype(out_dtype)
    amax = jnp.max(jnp.abs(out), initial=0).astype(jnp.float32) if emit_amax else jnp.zeros((), jnp.float32)
    return out, amax


_emulated_lowering = mlir.lower_fun(emulated_gemm, multiple_results=True)


# ---- CUDA lowering ----------------------------------------------------------------------------------------------
def ffi_attributes(a_fmt, b_fmt, emit_amax) -> dict:
    """The `jf4_gemm` attributes a_kind, b_kind (`ffi_codes.Kind`) and flags (`ffi_codes.GemmFlag`)."""
    flags = ((GemmFlag.A_LOCAL_1X64 if a_fmt.local_1x64 else 0) | (GemmFlag.B_LOCAL_1X64 if b_fmt.local_1x64 else 0)
             | (GemmFlag.EMIT_AMAX if emit_amax else 0))
    return dict(a_kind=np.int32(a_fmt.kind_code), b_kind=np.int32(b_fmt.kind_code), flags=np.int32(int(flags)))


def _cuda_lowering(ctx, *args, a_fmt, b_fmt, out_dtype, emit_amax):
    return jax.ffi.ffi_lowering(FFI_TARGET)(ctx, *args, **ffi_attributes(a_fmt, b_fmt, emit_amax))


def cuda_kernel_registered() -> bool:
    """Whether the CUDA extension provides `jf4_gemm` (its lowering is then registered for platform CUDA)."""
    return _ffi.ensure_registered() and FFI_TARGET in _ffi.targets()


register_lowerings(gemm_p, partitioning_gemm.gemm, _emulated_lowering,
                   cuda=_cuda_lowering if cuda_kernel_registered() else None)


# ---- batching ---------------------------------------------------------------------------------------------------
def _batch_rule(args, dims, *, a_fmt, b_fmt, out_dtype, emit_amax, local=False):
    params = dict(a_fmt=a_fmt, b_fmt=b_fmt, out_dtype=out_dtype, emit_amax=emit_amax)
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    if all(d is None for d in dims[3:]) and not a_fmt.has_tensor_amax and not emit_amax:
        # fold the batch into M: rows of A are independent (per-row scales and window amaxes, no tensor scale)
        a = [jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
             for x, d in zip(args[:3], dims[:3], strict=True)]
        rows = a[0].shape[1]
        a_aux = a[2].reshape(size * rows, -1) if a_fmt.local_1x64 else args[2] if dims[2] is None else a[2][0]
        out, _ = gemm_p.bind(a[0].reshape(size * rows, -1), a[1].reshape(size * rows, -1), a_aux, *args[3:],
                             **params)
        return (out.reshape(size, rows, -1), jnp.zeros((size,), jnp.float32)), (0, 0)
    mapped = [i for i, d in enumerate(dims) if d is not None]

    def one(xs):
        full = list(args)
        for i, x in zip(mapped, xs, strict=True):
            full[i] = x
        return tuple(gemm_p.bind(*full, **params))

    out, amax = lax.map(one, [jnp.moveaxis(args[i], dims[i], 0) for i in mapped])
    return (out, amax), (0, 0)


batching.primitive_batchers[gemm_p] = _batch_rule


def _no_jvp(primals, tangents, **params):
    raise TypeError("jf4_gemm (a block-scaled GEMM of quantized codes) has no derivative: differentiate through "
                    "jax_fp4.dense / dot_general, whose custom VJPs run the quantized fprop, dgrad and wgrad GEMMs")


ad.primitive_jvps[gemm_p] = _no_jvp


def gemm(a_data, a_scale, a_aux, b_data, b_scale, b_aux, bias=None, *, a_fmt, b_fmt, out_dtype=jnp.float32,
         emit_amax=False):
    """Bind `jf4_gemm` (operands and semantics in the module docstring); bias None means none.

    Returns:
      (out [M, N] out_dtype, out_amax float32 []: meaningful only with emit_amax).
    """
    bias = empty_operand(b_data) if bias is None else bias  # from B: batched only where B is (the batching rule)
    return tuple(gemm_p.bind(a_data, a_scale, a_aux, b_data, b_scale, b_aux, bias, a_fmt=a_fmt, b_fmt=b_fmt,
                             out_dtype=jnp.dtype(out_dtype), emit_amax=bool(emit_amax)))
