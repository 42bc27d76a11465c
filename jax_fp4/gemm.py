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
    bit for bit. "auto" takes it only for NVFP4 1x64 pairs (`auto_takes_kernel`): on an H200 (docs/performance.md
    "Block-scaled GEMM") it runs those at 3.3x the emulated route's float32 GEMM, but MXFP8 and NVFP4 1D at
    0.27-0.41x cuBLAS bf16, slower than the emulated route's bf16 GEMM over exact operands; there it is requested
    with implementation="kernel".
  * "native": `jax.nn.scaled_matmul` for MXFP8 x MXFP8 and NVFP4 1D x NVFP4 1D operands whose block axis is their
    only contracting axis and with no batch axes; the NVFP4 tensor scales are applied to its float32 result the same
    way. "auto" takes it on compute capability >= 10 (cuDNN's block-scaled GEMM on the tensor cores); it may be
    requested wherever `jax.nn.scaled_matmul` lowers (XLA's dequantize + dot decomposition on Hopper, and on the CPU
    with jax >= 0.11), which is how its operand layouts are checked against the emulated route without a Blackwell
    GPU. `gemm_route` says which route "auto" takes for a pair of formats.
RHT operands (the wgrad pair) must both carry the transform along the contracting axis: H is orthogonal, so the
product of the transformed operands is the product of the originals and no inverse is applied.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jax_fp4._src.primitives import gemm as _gemm_prim
from jax_fp4._src.primitives.gemm import exact_operand, exact_product
from jax_fp4.formats import Format
from jax_fp4.quantize import unswizzle_scales
from jax_fp4.quantized_array import ExactOperand, QuantizedArray
from jax_fp4.reference.nvfp4 import decode_amax, tensor_decode_scale

__all__ = ["scaled_dot_general", "exact_dot_general", "exact_operand", "ExactOperand", "native_gemm_available",
           "kernel_gemm_available", "kernel_formats_ok", "auto_takes_kernel", "scaled_matmul_lowers", "gemm_route",
           "IMPLEMENTATIONS",
           "canonical_dimension_numbers"]

IMPLEMENTATIONS = ("auto", "emulated", "native", "kernel")

# Whether implementation="auto" takes the jf4_gemm kernel on compute capability 9.x for every pair it runs (True) or
# only where it beat the emulated route on an H100 (False: NVFP4 1x64 pairs; `auto_takes_kernel`).
AUTO_TAKES_KERNEL = False


def auto_takes_kernel(fa, fb) -> bool:
    """Whether implementation="auto" puts a product of formats fa x fb on `jf4_gemm` where the kernel runs.

    NVFP4 1x64 pairs: measured on an H200 (benchmarks/gemm.py, docs/performance.md "Block-scaled GEMM") the kernel
    runs them at 159-170 TFLOP/s against the emulated route's 48-52 (a float32 GEMM of the dequantized operands).
    MXFP8 and NVFP4 1D pairs stay emulated: the kernel's 211-312 TFLOP/s are below the emulated route's cuBLAS bf16
    GEMM (551-749).
    With `AUTO_TAKES_KERNEL` every pair the kernel takes.
    """
    return AUTO_TAKES_KERNEL or bool(getattr(fa, "local_1x64", False) and getattr(fb, "local_1x64", False))


def native_gemm_available() -> bool:
    """True when the default device is a GPU of compute capability >= 10 (block-scaled tensor cores)."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return False
    try:
        return float(getattr(dev, "compute_capability", "0")) >= 10.0
    except ValueError:
        return False


def kernel_gemm_available() -> bool:
    """True when the default device is a GPU of compute capability 9.x (Hopper) and the CUDA extension provides the
    `jf4_gemm` kernel (sm_90a WGMMA): then implementation="kernel" may be requested, and "auto" takes it for the
    pairs `auto_takes_kernel` names."""
    dev = jax.devices()[0]
    if dev.platform != "gpu" or not _gemm_prim.cuda_kernel_registered():
        return False
    try:
        return 9.0 <= float(getattr(dev, "compute_capability", "0")) < 10.0
    except ValueError:
        return False


@functools.cache
def _lowers(fn, backend: str) -> bool:
    spec = jax.ShapeDtypeStruct((1, 1, 32), jnp.float8_e4m3fn)
    scale = jax.ShapeDtypeStruct((1, 1, 1), jnp.float8_e8m0fnu)
    try:
        jax.jit(fn).lower(spec, spec, scale, scale)  # on the default backend; `backend` keys the cache
    except NotImplementedError:  # "MLIR translation rule for primitive 'scaled_matmul' not found for platform ..."
        return False
    return True


def scaled_matmul_lowers() -> bool:
    """True when `jax.nn.scaled_matmul` lowers on the default backend (then implementation="native" may be asked).

    Probed once per backend by lowering a 1x1x32 MXFP8 product (no compilation): CUDA always (cuDNN on compute
    capability >= 10, XLA's dequantize + dot elsewhere), the CPU from jax 0.11 on.
    """
    return _lowers(jax.nn.scaled_matmul, jax.default_backend())


def _native_formats(fa, fb) -> bool:
    """Whether the native route takes a pair of formats: MXFP8 x MXFP8 (E4M3/E5M2) or NVFP4 1D x NVFP4 1D (no 2D
    scaling, RHT or 1x64 windows: cuDNN's block-scaled GEMM has one 1x16 E4M3 or 1x32 E8M0 scale per block)."""
    if not (isinstance(fa, Format) and isinstance(fb, Format)) or type(fa) is not type(fb):
        return False
    return not any(f.local_1x64 or f.rht or f.scaling_2d for f in (fa, fb))


def kernel_formats_ok(fa, fb) -> bool:
    """Whether `jf4_gemm` takes a pair of operand formats (NVFP4 1D/2D/RHT, MXFP8 E4M3/E5M2 in any pairing; NVFP4
    1x64 only with 1x64)."""
    return _gemm_prim.kernel_formats_ok(fa, fb)


def gemm_route(fa, fb) -> str:
    """The route implementation="auto" takes on the default device for a 2-D product without batch axes of operands
    in formats fa and fb, each blocked along the contracted axis (every GEMM of `jax_fp4.dense`): "kernel"
    (`jf4_gemm`, compute capability 9.x, for the pairs `auto_takes_kernel` names), "native" (compute capability
    >= 10) or "emulated"; "bf16" when fa or fb is None (an unquantized GEMM: plain `lax.dot_general`).

    Args:
      fa, fb: `jax_fp4.Format` instances or None (as a `jax_fp4.recipes.Recipe` names its operands).
    """
    if fa is None or fb is None:
        return "bf16"
    if auto_takes_kernel(fa, fb) and _gemm_prim.kernel_formats_ok(fa, fb) and kernel_gemm_available():
        return "kernel"
    return "native" if _native_formats(fa, fb) and native_gemm_available() else "emulated"


def canonical_dimension_numbers(dimension_numbers, lhs_ndim: int, rhs_ndim: int):
    """((cl, cr), (bl, br)) as tuples of non-negative ints.

    Raises:
      ValueError: a dimension outside its operand's rank (no modulo wrapping), a repeated dimension, or contracting
      / batch lists of different lengths.
    """
    try:
        (cl, cr), (bl, br) = dimension_numbers
    except (TypeError, ValueError):
        raise ValueError(f"dot_general: dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, "
                         f"rhs_batch)), got {dimension_numbers!r}") from None
    out = []
    for dims, nd, side in ((cl, lhs_ndim, "lhs contracting"), (cr, rhs_ndim, "rhs contracting"),
                           (bl, lhs_ndim, "lhs batch"), (br, rhs_ndim, "rhs batch")):
        dims = tuple(int(d) for d in dims)
        for d in dims:
            if not -nd <= d < nd:
                raise ValueError(f"dot_general: {side} dimension {d} is out of range for an operand of rank {nd} "
                                 f"(dimension numbers {dimension_numbers})")
        out.append(tuple(d % nd for d in dims))
    cl, cr, bl, br = out
    if len(cl) != len(cr) or len(bl) != len(br):
        raise ValueError(f"dot_general: contracting / batch dimensions do not pair up: {dimension_numbers}")
    if len(set(cl + bl)) != len(cl + bl) or len(set(cr + br)) != len(cr + br):
        raise ValueError(f"dot_general: a dimension is listed twice in {dimension_numbers}")
    return (cl, cr), (bl, br)


def _check(a, b, dimension_numbers):
    for name, q in (("lhs", a), ("rhs", b)):
        if not isinstance(q, QuantizedArray):
            raise ValueError(f"scaled_dot_general: {name} must be a jax_fp4.QuantizedArray, got {type(q).__name__}")
        q.validate()
    (ca, cb), (ba, bb) = canonical_dimension_numbers(dimension_numbers, len(a.shape), len(b.shape))
    for d0, d1 in zip(ca + ba, cb + bb, strict=True):
        if a.shape[d0] != b.shape[d1]:
            raise ValueError(f"scaled_dot_general: lhs dimension {d0} ({a.shape[d0]}) != rhs dimension {d1} "
                             f"({b.shape[d1]}) for lhs {a!r} and rhs {b!r} with {dimension_numbers}")
    for name, q, c in (("lhs", a, ca), ("rhs", b, cb)):
        if q.axis % len(q.shape) not in c:
            raise ValueError(
                f"scaled_dot_general: the block axis {q.axis} of {name} {q!r} must be one of its contracting "
                f"dimensions {c} (block scales vary along the contraction)"
            )
    rht = [q.fmt.rht for q in (a, b)]
    if rht[0] != rht[1]:
        raise ValueError(f"scaled_dot_general: RHT operands come in pairs (the transform cancels): {a!r} x {b!r}")
    return ((ca, cb), (tuple(ba), tuple(bb)))


def _native_ok(a, b, dn) -> bool:
    (ca, cb), (ba, bb) = dn
    if ba or bb or len(ca) != 1 or a.ndim != 2 or b.ndim != 2:
        return False
    return _native_formats(a.fmt, b.fmt)


def _native_operand(q: QuantizedArray):
    """[1, rows, K] data and [1, rows, K/bs] scales with the contracting (block) axis last."""
    q = unswizzle_scales(q)
    if q.fmt.stores_block_axis_last:
        data, scale = q.data, q.scale  # stored block axis last
    else:
        data, scale = jnp.moveaxis(q.data, q.axis, -1), jnp.moveaxis(q.scale, q.axis, -1)
    return data[None], scale[None]


def _out_shape(a, b, dn) -> tuple[int, ...]:
    (ca, cb), (ba, bb) = dn
    free_a = [a.shape[i] for i in range(len(a.shape)) if i not in ca and i not in ba]
    free_b = [b.shape[i] for i in range(len(b.shape)) if i not in cb and i not in bb]
    return (*(a.shape[i] for i in ba), *free_a, *free_b)


def _check_bias(bias, a, b, dn):
    """bias as float32 [out.shape[-1]], or None."""
    if bias is None:
        return None
    shape = _out_shape(a, b, dn)
    if not shape or jnp.shape(bias) != shape[-1:] or not jnp.issubdtype(jnp.result_type(bias), jnp.floating):
        raise ValueError(f"scaled_dot_general: bias must be a float array of shape {shape[-1:]} (the last axis of the "
                         f"product {shape}), got {jnp.result_type(bias)}{list(jnp.shape(bias))}")
    return jnp.asarray(bias).astype(jnp.float32)


def _kernel_ok(a, b, dn, bias) -> bool:
    """Whether `jf4_gemm` takes the product: no batch axes, one contracting axis per operand (then the block axis),
    a kernel format pair, scalar NVFP4 tensor amaxes, and (with a bias) a free axis of b to carry it."""
    (ca, _), (ba, bb) = dn
    if ba or bb or len(ca) != 1 or not _gemm_prim.kernel_formats_ok(a.fmt, b.fmt):
        return False
    if any(q.fmt.has_tensor_amax and jnp.ndim(q.amax) != 0 for q in (a, b)):
        return False
    return bias is None or len(b.shape) > 1


def _kernel_operand(q: QuantizedArray):
    """((data [rows, K], compact scales [rows, K/bs], aux), free shape) of the `jf4_gemm` operand of q.

    The block (contracting) axis is moved last: NVFP4 stores it there; MXFP8 data and scales blocked along another
    axis are transposed (1-byte arrays). Swizzled scales are unswizzled. aux: the 1x64 window amax [rows, K/64],
    decode_amax(amax) (NVFP4 with a tensor amax, see jax_fp4/_src/primitives/gemm.py) or float32[0].
    """
    q = unswizzle_scales(q)
    fmt, k = q.fmt, q.shape[q.axis]
    if fmt.stores_block_axis_last:
        data, scale = q.data, q.scale
    else:
        data, scale = jnp.moveaxis(q.data, q.axis, -1), jnp.moveaxis(q.scale, q.axis, -1)
    free = tuple(data.shape[:-1])
    rows = math.prod(free)
    if fmt.local_1x64:
        aux = q.window_amax.reshape(rows, k // fmt.window_size)
    elif fmt.has_tensor_amax:
        aux = decode_amax(q.amax)
    else:
        aux = jnp.zeros((0,), jnp.float32)
    return (data.reshape(rows, k), scale.reshape(rows, k // fmt.block_size), aux), free


def _finish(out, bias, out_dtype, return_amax):
    """The float32 product -> + bias (float32), one cast, and the output amax when asked."""
    if bias is not None:
        out = out + bias
    out = out.astype(out_dtype)
    if not return_amax:
        return out
    return out, jnp.max(jnp.abs(out), initial=0).astype(jnp.float32)


def _kernel_gemm(a, b, dn, out_dtype, bias, return_amax):
    (da, sa, xa), free_a = _kernel_operand(a)
    (db, sb, xb), free_b = _kernel_operand(b)
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


def _route(a, b, dn, implementation, bias) -> str:
    if implementation == "kernel":
        if not _kernel_ok(a, b, dn, bias):
            raise ValueError(f"scaled_dot_general: no jf4_gemm kernel for {a!r} x {b!r} with {dn} (it takes operands "
                             "without batch axes, each contracted along its block axis only; NVFP4 1x64 pairs only "
                             "with NVFP4 1x64; a bias needs a free axis of rhs)")
        if not kernel_gemm_available():
            raise ValueError(f"scaled_dot_general: no jf4_gemm kernel on {jax.devices()[0]}: it needs a GPU of compute "
                             "capability 9.x and the CUDA extension built with jf4_gemm (CUDA extension: "
                             f"{_gemm_prim.cuda_kernel_registered()})")
        return "kernel"
    if implementation == "native":
        if not _native_ok(a, b, dn):
            raise ValueError(f"scaled_dot_general: no native block-scaled GEMM for {a!r} x {b!r} (it takes 2-D MXFP8 x "
                             "MXFP8 or NVFP4 1D x NVFP4 1D operands contracted along their block axis only)")
        if not scaled_matmul_lowers():
            raise ValueError(f"scaled_dot_general: no native block-scaled GEMM on {jax.devices()[0]}: "
                             f"jax.nn.scaled_matmul does not lower on {jax.default_backend()} (jax {jax.__version__})")
        return "native"
    if implementation == "auto":
        if auto_takes_kernel(a.fmt, b.fmt) and _kernel_ok(a, b, dn, bias) and kernel_gemm_available():
            return "kernel"
        if _native_ok(a, b, dn) and native_gemm_available():
            return "native"
    return "emulated"


def scaled_dot_general(a: QuantizedArray, b: QuantizedArray, dimension_numbers, preferred_element_type=jnp.float32,
                       *, implementation: str = "auto", bias=None, return_amax: bool = False):
    """Block-scaled `lax.dot_general` of two QuantizedArrays.

    Args:
      a, b: QuantizedArrays (compact or swizzled scales); `dimension_numbers` refers to their logical shapes
        (`a.shape`, `b.shape`), as for `lax.dot_general`: ((lhs_contracting, rhs_contracting), (lhs_batch,
        rhs_batch)). Each operand's block axis must be one of its contracting dimensions.
      preferred_element_type: result dtype (float32 default; the accumulation is float32 either way).
      implementation: "auto" (the `jf4_gemm` kernel on compute capability 9.x, native on >= 10, where the operands
        allow; else emulated), "emulated", "kernel" (`jf4_gemm`: 2-D products, see the module docstring; needs
        `kernel_gemm_available()`) or "native" (where the formats allow and `jax.nn.scaled_matmul` lowers:
        `scaled_matmul_lowers`).
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
    dn = _check(a, b, dimension_numbers)
    bias = _check_bias(bias, a, b, dn)
    out_dtype = jnp.dtype(preferred_element_type)
    route = _route(a, b, dn, implementation, bias)
    if route == "kernel":
        return _kernel_gemm(a, b, dn, out_dtype, bias, return_amax)
    if route == "emulated":
        return _finish(exact_dot_general(a, b, dn, jnp.float32), bias, out_dtype, return_amax)
    da, sa = _native_operand(a)
    db, sb = _native_operand(b)
    out = jax.nn.scaled_matmul(da, db, sa, sb, preferred_element_type=jnp.float32)[0]
    for q in (a, b):
        if q.fmt.has_tensor_amax:
            out = out * tensor_decode_scale(q.amax)
    return _finish(out, bias, out_dtype, return_amax)


def exact_dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32):
    """The emulated block-scaled product of two operands, each a QuantizedArray or an ExactOperand.

    The exact values multiply as a `lax.dot_general` with float32 accumulation (products exact: bfloat16 operands,
    or float32 for NVFP4 1x64), then the tensor scales multiply the float32 result (docs/numerics.md "GEMM emulation";
    `jax_fp4._src.primitives.gemm.exact_product`, which the `jf4_gemm` primitive's emulated lowering shares).
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
