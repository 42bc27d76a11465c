"""`exact_product`, the float32 emulated product of two exact operands, and its XLA:CPU guard (package docstring)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = ["exact_product", "cpu_narrow_dot_guard"]


def exact_product(ops, dimension_numbers):
    """The float32 emulated product of two (values, tensor_scale) operands: a `lax.dot_general` at HIGHEST precision
    with float32 accumulation (bfloat16 operands, float32 when either is float32), then the tensor scales multiply
    the float32 result, lhs's first (docs/numerics.md "GEMM emulation")."""
    (va, ta), (vb, tb) = ops
    dt = jnp.float32 if jnp.float32 in (va.dtype, vb.dtype) else jnp.bfloat16

    def dot(a, b):
        return lax.dot_general(a.astype(dt), b.astype(dt), dimension_numbers, precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)

    out = dot(va, vb) if dt == jnp.float32 else cpu_narrow_dot_guard(dot, va, vb)
    for t in (ta, tb):
        if t is not None:
            out = out * t
    return out


def cpu_narrow_dot_guard(dot, *operands):
    """``dot(*operands)``, a dot of bfloat16 (or float16) operands with a float32 result, kept as written on the CPU.

    XLA:CPU runs such a dot only inside its XNNPACK dot fusion, which takes some operand layouts and not others;
    XLA's algebraic simplifier folds a transpose of the dot's result into the dot (swapping its operands), and in a
    three-operand einsum's gradient that leaves a dot the fusion does not take, which the fallback, DotThunk, cannot
    run ("UNIMPLEMENTED: Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"). An optimization barrier
    on the result keeps the transpose outside. The dot, its bits and every other platform's program (CUDA's cuBLAS
    GEMMs) are unchanged (`lax.platform_dependent`)."""
    return lax.platform_dependent(*operands, cpu=lambda *a: lax.optimization_barrier(dot(*a)), default=dot)
