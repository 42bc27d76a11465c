"""`scaled_dot_general`: the product of two QuantizedArrays (docs/numerics.md, "GEMM emulation").

Two implementations, chosen at trace time:
  * "emulated" (CPU, Hopper, any platform): each operand becomes its exact block-scaled values (value(q) * s_b for
    NVFP4 1D/2D/RHT, value(q) * 2**(e-127) for MXFP8; exact in bfloat16: at most 6 significant bits), the product
    runs as a bfloat16 x bfloat16 `dot_general` with float32 accumulation (products exact), and the NVFP4 tensor
    scales (amax / 2688 per operand) multiply the float32 result afterwards. 1x64 operands enter as their
    dequantized float32 values (their window scales do not factor out of the sum), a product no vendor library
    offers today.
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

import jax
import jax.numpy as jnp
from jax import lax

from jax_fp4._src.primitives.dequantize import block_scaled_values, dequantize_array
from jax_fp4.formats import Format
from jax_fp4.quantize import unswizzle_scales
from jax_fp4.quantized_array import ExactOperand, QuantizedArray
from jax_fp4.reference.nvfp4 import tensor_decode_scale

__all__ = ["scaled_dot_general", "exact_dot_general", "ExactOperand", "native_gemm_available", "scaled_matmul_lowers",
           "gemm_route", "IMPLEMENTATIONS", "canonical_dimension_numbers"]

IMPLEMENTATIONS = ("auto", "emulated", "native")


def native_gemm_available() -> bool:
    """True when the default device is a GPU of compute capability >= 10 (block-scaled tensor cores)."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return False
    try:
        return float(getattr(dev, "compute_capability", "0")) >= 10.0
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


def gemm_route(fa, fb) -> str:
    """The route implementation="auto" takes on the default device for a 2-D product without batch axes of operands
    in formats fa and fb, each blocked along the contracted axis (every GEMM of `jax_fp4.dense`): "native" or
    "emulated"; "bf16" when fa or fb is None (an unquantized GEMM: plain `lax.dot_general`).

    Args:
      fa, fb: `jax_fp4.Format` instances or None (as a `jax_fp4.recipes.Recipe` names its operands).
    """
    if fa is None or fb is None:
        return "bf16"
    return "native" if _native_formats(fa, fb) and native_gemm_available() else "emulated"


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
        return block_scaled_values(q), tensor_decode_scale(q.amax)
    return dequantize_array(q, jnp.bfloat16), None


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


def scaled_dot_general(a: QuantizedArray, b: QuantizedArray, dimension_numbers, preferred_element_type=jnp.float32,
                       *, implementation: str = "auto"):
    """Block-scaled `lax.dot_general` of two QuantizedArrays.

    Args:
      a, b: QuantizedArrays (compact or swizzled scales); `dimension_numbers` refers to their logical shapes
        (`a.shape`, `b.shape`), as for `lax.dot_general`: ((lhs_contracting, rhs_contracting), (lhs_batch,
        rhs_batch)). Each operand's block axis must be one of its contracting dimensions.
      preferred_element_type: result dtype (float32 default; the accumulation is float32 either way).
      implementation: "auto" (native on compute capability >= 10 where the formats allow, else emulated),
        "emulated" or "native" (where the formats allow and `jax.nn.scaled_matmul` lowers: `scaled_matmul_lowers`).

    Returns:
      The product in `preferred_element_type`, shaped as `lax.dot_general`'s.

    Raises:
      ValueError: non-QuantizedArray operands; a block axis that is not contracted; one RHT operand without the
      other; implementation="native" where the formats do not allow it or `jax.nn.scaled_matmul` does not lower.

    Numerics: docs/numerics.md "GEMM emulation": sum of exact block-scaled products accumulated in float32, then the
    tensor scales (amax_a / 2688) * (amax_b / 2688) for NVFP4.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"scaled_dot_general: implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    dn = _check(a, b, dimension_numbers)
    if implementation == "native":
        if not _native_ok(a, b, dn):
            raise ValueError(f"scaled_dot_general: no native block-scaled GEMM for {a!r} x {b!r} (it takes 2-D MXFP8 x "
                             "MXFP8 or NVFP4 1D x NVFP4 1D operands contracted along their block axis only)")
        if not scaled_matmul_lowers():
            raise ValueError(f"scaled_dot_general: no native block-scaled GEMM on {jax.devices()[0]}: "
                             f"jax.nn.scaled_matmul does not lower on {jax.default_backend()} (jax {jax.__version__})")
        native = True
    else:
        native = implementation == "auto" and _native_ok(a, b, dn) and native_gemm_available()
    if native:
        da, sa = _native_operand(a)
        db, sb = _native_operand(b)
        out = jax.nn.scaled_matmul(da, db, sa, sb, preferred_element_type=jnp.float32)[0]
        ta = tensor_decode_scale(a.amax) if a.fmt.has_tensor_amax else None
        tb = tensor_decode_scale(b.amax) if b.fmt.has_tensor_amax else None
    else:
        return exact_dot_general(a, b, dn, preferred_element_type)
    for t in (ta, tb):
        if t is not None:
            out = out * t
    return out.astype(preferred_element_type)


def exact_dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32):
    """The emulated block-scaled product of two operands, each a QuantizedArray or an ExactOperand.

    The exact values multiply as a `lax.dot_general` with float32 accumulation (products exact: bfloat16 operands,
    or float32 for NVFP4 1x64), then the tensor scales multiply the float32 result (docs/numerics.md "GEMM emulation").
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
    (va, ta), (vb, tb) = ops
    dt = jnp.float32 if jnp.float32 in (va.dtype, vb.dtype) else jnp.bfloat16
    out = lax.dot_general(va.astype(dt), vb.astype(dt), dimension_numbers, precision=lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
    for t in (ta, tb):
        if t is not None:
            out = out * t
    return out.astype(preferred_element_type)
