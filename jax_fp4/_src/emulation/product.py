"""`exact_product`, the float32 emulated product of two exact operands, and its XLA:CPU form (package docstring)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = ["exact_product", "cpu_float32_operands"]


def exact_product(ops, dimension_numbers):
    """The float32 emulated product of two (values, tensor_scale) operands: a `lax.dot_general` at HIGHEST precision
    with float32 accumulation (bfloat16 operands, float32 when either is float32; float32 on the CPU, see
    `cpu_float32_operands`), then the tensor scales multiply the float32 result, lhs's first (docs/numerics.md
    "GEMM emulation")."""
    (va, ta), (vb, tb) = ops
    dt = jnp.float32 if jnp.float32 in (va.dtype, vb.dtype) else jnp.bfloat16

    def dot(a, b):
        return lax.dot_general(a, b, dimension_numbers, precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)

    va, vb = va.astype(dt), vb.astype(dt)
    out = dot(va, vb) if dt == jnp.float32 else cpu_float32_operands(dot, va, vb)
    for t in (ta, tb):
        if t is not None:
            out = out * t
    return out


def cpu_float32_operands(dot, *operands):
    """``dot(*operands)`` for a dot of bfloat16 (or float16) operands with a float32 result; on the CPU the operands
    are widened to float32 first, so the package emits no bfloat16 x bfloat16 -> float32 dot there.

    XLA:CPU runs such a dot only inside its XNNPACK dot fusion, which takes some operand layouts and batch forms and
    not others; a dot left outside it falls back to DotThunk, which cannot run it ("UNIMPLEMENTED: Unsupported
    element type for DotThunk::Execute: BF16 x BF16 = F32": the gradient of a three-operand einsum, whose transposes
    XLA folds into the dot, and the same under vmap, where XLA merges the per-example products into one batched
    dot). Widening is exact (a bfloat16 value is a float32 value, the products of exact operands are exact in
    float32) and the accumulation is float32 either way. Every other platform's program (CUDA's cuBLAS GEMMs) is
    unchanged (`lax.platform_dependent`)."""
    def wide(*a):
        return dot(*(x.astype(jnp.float32) for x in a))

    return lax.platform_dependent(*operands, cpu=wide, default=dot)
