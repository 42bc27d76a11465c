"""Helpers shared by the primitive modules: the eager `impl` rule, the FFI-or-reference lowering switch and the
placeholder of an absent operand."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jax_fp4._src import jax_compat


def empty_operand(like, dtype=jnp.float32):
    """The [0] placeholder of an absent operand (an unused amax, window amax, bias or aux), sliced from `like`, an
    operand of the same call, instead of a constant.

    A constant placeholder is loop invariant: when the call runs in a `jax.shard_map` body inside a `lax.scan`
    (scanned expert-parallel MoE blocks), the scan's partial evaluation hoists it out of the loop into a separate
    shard_map, and the zero-size array enters the layer's shard_map as an operand. XLA (jaxlib 0.11.2) replaces
    zero-size operands with constants before Shardy imports the manual computation, and Shardy then crashes
    (SIGSEGV in ManualComputationUnusedInputsPattern; `tools/dev/shardy_zero_size_repro.py` shows it in plain
    JAX). Sliced from an operand, the placeholder is computed next to its consumer. It has no elements either
    way, so no value changes; under vmap it is batched like `like` (the batching rules accept that)."""
    flat = jnp.ravel(like)
    return lax.slice(flat, (0,), (0,)).astype(dtype)


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
