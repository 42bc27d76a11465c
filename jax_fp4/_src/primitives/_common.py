"""Helpers shared by the primitive modules: the eager `impl` rule and the FFI-or-reference lowering switch."""

from __future__ import annotations

from functools import partial

import jax

from jax_fp4._src import jax_compat


def def_impl(prim) -> None:
    """Eager rule: compile the primitive alone (`jax_compat.apply_primitive`: jax's own, on jax 0.10-0.12)."""
    apply_primitive = jax_compat.apply_primitive()
    if apply_primitive is not None:
        prim.def_impl(partial(apply_primitive, prim))
    else:  # pragma: no cover
        prim.def_impl(lambda *args, **params: jax.jit(partial(prim.bind, **params))(*args))


NOT_DIFFERENTIABLE = (
    "{name} (quantization) has no derivative: its outputs are codes and block scales, piecewise constant in x. For "
    "a straight-through gradient use jax_fp4.fake_quantize(x, fmt) (dequantize(quantize(x)) with an STE "
    "gradient); for quantized training use jax_fp4.dense / dot_general / ragged_dot, whose custom VJPs quantize the "
    "gradient GEMMs (reverse-mode only: jax.grad, jax.vjp, jax.jacrev; not jax.jvp, jax.jacfwd, jax.hessian)."
)


def def_not_differentiable(prim) -> None:
    """A JVP rule that raises TypeError explaining why `prim` has no derivative and what to use instead (JAX's own
    message, "Differentiation rule ... not implemented", reads like a missing feature). Zero tangents never reach
    it: JAX skips the rule when every input tangent is a symbolic zero."""
    from jax.interpreters import ad

    def rule(primals, tangents, **params):
        raise TypeError(NOT_DIFFERENTIABLE.format(name=prim.name))

    ad.primitive_jvps[prim] = rule
