"""`scaled_dot_general`: the product of two QuantizedArrays (docs/numerics.md, "GEMM emulation").

Three implementations, chosen at trace time:
  * "emulated" (CPU, any platform): each operand becomes its exact block-scaled values (value(q) * s_b for
    NVFP4 1D/2D/RHT, value(q) * 2**(e-127) for MXFP8; exact in bfloat16: at most 6 significant bits), the product
    runs as a bfloat16 x bfloat16 `dot_general` with float32 accumulation (products exact), and the NVFP4 tensor
    scales (amax / 2688 per operand) multiply the float32 result afterwards. 1x64 operands enter as their
    dequantized float32 values (their window scales do not factor out of the sum), a product no vendor library
    offers today.
  * "kernel": the `jf4_gemm` primitive (jax_fp4/_src/primitives/gemm.py), a CUDA sm_90a kernel that decodes the
    packed codes and block scales to bfloat16 on chip, accumulates in float32 (1x64: window partial sums promoted
    with the window decode factors) and applies the tensor scales, an optional bias and the output amax in its
    epilogue; the same semantics as "emulated" up to the accumulation order. It takes 2-D products: no batch axes,
    one contracting axis per operand (the block axis); the free axes of each operand are folded into M / N. Its
    operands are converted first: swizzled scales unswizzled, MXFP8 data and scales blocked along a non-last axis
    transposed to K-major (NVFP4 2D scales are stored per row already). It runs on compute capability 9.x when the
    CUDA extension provides `jf4_gemm` (`kernel_gemm_available`); elsewhere the primitive lowers to the emulation,
    bit for bit. "auto" takes it only for NVFP4 1x64 pairs (`jax_fp4.route.auto_takes_kernel`: faster than the
    emulated route's float32 GEMM for those, slower than its bf16 GEMM over exact operands for MXFP8 and NVFP4 1D;
    docs/performance.md, "Block-scaled GEMM"); there it is requested with implementation="kernel".
  * "native": `jax.nn.scaled_matmul` for MXFP8 x MXFP8 and NVFP4 1D x NVFP4 1D operands whose block axis is their
    only contracting axis and with no batch axes; the NVFP4 tensor scales are applied to its float32 result the same
    way. "auto" takes it on compute capability >= 10 (cuDNN's block-scaled GEMM on the tensor cores); it may be
    requested wherever `jax.nn.scaled_matmul` lowers (XLA's dequantize + dot decomposition on Hopper, and on the CPU
    with jax >= 0.11), which is how its operand layouts are checked against the emulated route without a Blackwell
    GPU.
The route is `jax_fp4.route.gemm_route`'s answer for the operands' formats on the default device.
RHT operands (the wgrad pair) must both carry the transform along the contracting axis: H is orthogonal, so the
product of the transformed operands is the product of the originals and no inverse is applied.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_fp4._src.dimension_numbers import canonical_dimension_numbers, check_dot_shapes
from jax_fp4._src.emulation.product import exact_product
from jax_fp4._src.primitives import gemm as _gemm_prim
from jax_fp4._src.primitives.gemm import exact_operand
from jax_fp4._src.primitives.gemm_operands import kernel_operand, native_operand
from jax_fp4.quantized_array import ExactOperand, QuantizedArray
from jax_fp4.reference.nvfp4 import tensor_decode_scale
from jax_fp4.route import (
    IMPLEMENTATIONS,
    gemm_route,
    kernel_gemm_available,
    native_gemm_available,
    scaled_matmul_lowers,
)

__all__ = ["scaled_dot_general", "exact_dot_general", "exact_operand", "ExactOperand", "IMPLEMENTATIONS",
           "canonical_dimension_numbers", "gemm_route", "kernel_gemm_available", "native_gemm_available",
           "scaled_matmul_lowers"]


def _check(a, b, dimension_numbers):
    """(canonical dimension numbers, product shape) of two valid QuantizedArrays contracted along their block axes."""
    for name, q in (("lhs", a), ("rhs", b)):
        if not isinstance(q, QuantizedArray):
            raise ValueError(f"scaled_dot_general: {name} must be a jax_fp4.QuantizedArray, got {type(q).__name__}")
        q.validate()
    dn, shape = check_dot_shapes(dimension_numbers, a.shape, b.shape, "scaled_dot_general")
    (ca, cb), _ = dn
    for name, q, c in (("lhs", a, ca), ("rhs", b, cb)):
        if q.axis % len(q.shape) not in c:
            raise ValueError(
                f"scaled_dot_general: the block axis {q.axis} of {name} {q!r} must be one of its contracting "
                f"dimensions {c} (block scales vary along the contraction)"
            )
    rht = [q.fmt.rht for q in (a, b)]
    if rht[0] != rht[1]:
        raise ValueError(f"scaled_dot_general: RHT operands come in pairs (the transform cancels): {a!r} x {b!r}")
    return dn, shape


def _check_bias(bias, shape):
    """bias as float32 [shape[-1]] (shape: the product's), or None."""
    if bias is None:
        return None
    if not shape or jnp.shape(bias) != shape[-1:] or not jnp.issubdtype(jnp.result_type(bias), jnp.floating):
        raise ValueError(f"scaled_dot_general: bias must be a float array of shape {shape[-1:]} (the last axis of the "
                         f"product {shape}), got {jnp.result_type(bias)}{list(jnp.shape(bias))}")
    return jnp.asarray(bias).astype(jnp.float32)


def _single_contraction(a, b, dn) -> bool:
    """No batch axes and one contracting axis per operand (then the block axis)."""
    (ca, _), (ba, bb) = dn
    return not ba and not bb and len(ca) == 1


def _kernel_fits(a, b, dn, bias) -> bool:
    """Whether `jf4_gemm` takes the operands' shapes: a single contraction, scalar NVFP4 tensor amaxes, and (with a
    bias) a free axis of b to carry it."""
    if not _single_contraction(a, b, dn) or any(q.fmt.has_tensor_amax and jnp.ndim(q.amax) != 0 for q in (a, b)):
        return False
    return bias is None or len(b.shape) > 1


def _native_fits(a, b, dn) -> bool:
    return _single_contraction(a, b, dn) and a.ndim == 2 and b.ndim == 2


def _route(a, b, dn, implementation, bias) -> str:
    kernel_fits, native_fits = _kernel_fits(a, b, dn, bias), _native_fits(a, b, dn)
    route = gemm_route(a.fmt, b.fmt, implementation, kernel_fits=kernel_fits, native_fits=native_fits,
                       caller="scaled_dot_general")
    if implementation == "kernel" and route != "kernel":
        raise ValueError(f"scaled_dot_general: no jf4_gemm kernel for {a!r} x {b!r} with {dn} (it takes operands "
                         "without batch axes, each contracted along its block axis only; NVFP4 1x64 pairs only "
                         "with NVFP4 1x64; no 4over6 operands (its tensor scale is the 448 bound's); a bias needs a "
                         "free axis of rhs)")
    if implementation == "native" and route != "native":
        raise ValueError(f"scaled_dot_general: no native block-scaled GEMM for {a!r} x {b!r} (it takes 2-D MXFP8 x "
                         "MXFP8 or NVFP4 1D x NVFP4 1D operands contracted along their block axis only)")
    return route


def _finish(out, bias, out_dtype, return_amax):
    """The float32 product -> + bias (float32), one cast, and the output amax when asked."""
    if bias is not None:
        out = out + bias
    out = out.astype(out_dtype)
    if not return_amax:
        return out
    return out, jnp.max(jnp.abs(out), initial=0).astype(jnp.float32)


def _kernel_gemm(a, b, dn, out_dtype, bias, return_amax):
    (da, sa, xa), free_a = kernel_operand(a)
    (db, sb, xb), free_b = kernel_operand(b)
    if 0 in (da.shape[0], db.shape[0], da.shape[1]):  # nothing for the kernel to do (it takes M, N, K >= 1)
        return _finish(exact_dot_general(a, b, dn, jnp.float32), bias, out_dtype, return_amax)
    kernel_dtype = out_dtype if out_dtype in _gemm_prim.OUT_DTYPES else jnp.dtype(jnp.float32)
    emit = return_amax and kernel_dtype == out_dtype  # else the amax of the cast result is taken below
    bias_n = None if bias is None else jnp.broadcast_to(bias, free_b).reshape(db.shape[0])
    out, amax = _gemm_prim.gemm(da, sa, xa, db, sb, xb, bias_n, a_fmt=a.fmt, b_fmt=b.fmt, out_dtype=kernel_dtype,
                                emit_amax=emit)
    out = out.reshape(*free_a, *free_b)
    if emit:
        return out, amax
    return _finish(out, None, out_dtype, return_amax)


def _native_gemm(a, b):
    """The float32 product on `jax.nn.scaled_matmul`, the NVFP4 tensor scales applied to its result."""
    (da, sa), (db, sb) = native_operand(a), native_operand(b)
    out = jax.nn.scaled_matmul(da, db, sa, sb, preferred_element_type=jnp.float32)[0]
    for q in (a, b):
        if q.fmt.has_tensor_amax:
            out = out * tensor_decode_scale(q.amax, q.fmt.global_e4m3_max)
    return out

def scaled_dot_general(a: QuantizedArray, b: QuantizedArray, dimension_numbers, preferred_element_type=jnp.float32,
                       *, implementation: str = "auto", bias=None, return_amax: bool = False):
    """Block-scaled `lax.dot_general` of two QuantizedArrays.

    Args:
      a, b: QuantizedArrays (compact or swizzled scales); `dimension_numbers` refers to their logical shapes
        (`a.shape`, `b.shape`), as for `lax.dot_general`: ((lhs_contracting, rhs_contracting), (lhs_batch,
        rhs_batch)). Each operand's block axis must be one of its contracting dimensions.
      preferred_element_type: result dtype (float32 default; the accumulation is float32 either way).
      implementation: "auto" (`jax_fp4.route.gemm_route`: the `jf4_gemm` kernel on compute capability 9.x for
        NVFP4 1x64 pairs, native on >= 10, where the operands allow; else emulated), "emulated", "kernel"
        (`jf4_gemm`: 2-D products, see the module docstring; needs `kernel_gemm_available()`) or "native" (where
        the formats allow and `jax.nn.scaled_matmul` lowers: `scaled_matmul_lowers`).
      bias: optional float array [out.shape[-1]], added in float32 after the tensor scales and before the cast to
        `preferred_element_type` (fused into the kernel's epilogue on the "kernel" route).
      return_amax: also return max |out| (float32 scalar, of the cast result; NaN when an output is NaN; 0 for an
        empty product), computed by the kernel's epilogue on the "kernel" route.

    Returns:
      The product in `preferred_element_type`, shaped as `lax.dot_general`'s; with return_amax, (product, amax).

    Raises:
      ValueError: non-QuantizedArray operands; a block axis that is not contracted; one RHT operand without the
      other; a bias of another shape; implementation="native" where the formats do not allow it or
      `jax.nn.scaled_matmul` does not lower; implementation="kernel" where the operands do not allow it or no
      `jf4_gemm` kernel runs on the default device.

    Numerics: docs/numerics.md "GEMM emulation": sum of exact block-scaled products accumulated in float32, then the
    tensor scales (amax_a / 2688) * (amax_b / 2688) for NVFP4.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"scaled_dot_general: implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    dn, shape = _check(a, b, dimension_numbers)
    bias = _check_bias(bias, shape)
    out_dtype = jnp.dtype(preferred_element_type)
    route = _route(a, b, dn, implementation, bias)
    if route == "kernel":
        return _kernel_gemm(a, b, dn, out_dtype, bias, return_amax)
    out = _native_gemm(a, b) if route == "native" else exact_dot_general(a, b, dn, jnp.float32)
    return _finish(out, bias, out_dtype, return_amax)


def exact_dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32):
    """The emulated block-scaled product of two operands, each a QuantizedArray or an ExactOperand.

    The exact values multiply as a `lax.dot_general` with float32 accumulation (products exact: bfloat16 operands,
    or float32 for NVFP4 1x64), then the tensor scales multiply the float32 result (docs/numerics.md "GEMM emulation";
    `jax_fp4._src.emulation.product.exact_product`, which the `jf4_gemm` primitive's emulated lowering shares).
    `scaled_dot_general` validates QuantizedArray pairs (block axes contracted, RHT in pairs) before it comes here;
    ExactOperands carry no format, so that is the caller's contract (`jax_fp4.dense` pairs them by its recipe).

    Raises:
      ValueError: an operand that is neither a QuantizedArray nor an ExactOperand.
    """
    # The barrier keeps XLA from fusing the operands' producers (e.g. the reference quantize's integer chains on
    # CPU) into the decode below; jax >= 0.11's algebraic simplifier otherwise loops for minutes on the mix.
    ops = []
    for name, q in (("lhs", a), ("rhs", b)):
        if isinstance(q, QuantizedArray):
            ops.append(exact_operand(lax.optimization_barrier(q)))
        elif isinstance(q, ExactOperand):
            ops.append(q)
        else:
            raise ValueError(f"exact_dot_general: {name} must be a QuantizedArray or an ExactOperand, got "
                             f"{type(q).__name__}")
    return exact_product(ops, dimension_numbers).astype(preferred_element_type)
