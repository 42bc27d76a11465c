"""Helpers shared by the custom-VJP GEMMs (`jax_fp4.dense`, `jax_fp4.grouped_gemm`) and the layers that call them."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_fp4._src import jax_compat

__all__ = ["dtype_tag", "operand_keys", "forward_mode_message", "refuse_forward_mode", "reverse_mode_only"]


def operand_keys(key):
    """(x, w, dy) stochastic-rounding keys: `jax.random.split(key, 3)`, or three Nones when `key` is None."""
    if key is None:
        return None, None, None
    return tuple(jax.random.split(key, 3))


def dtype_tag(a):
    """A zero-size array carrying a's dtype (residuals must be arrays, so a pullback can leave jax.jit)."""
    return jnp.zeros((0,), a.dtype)


def forward_mode_message(where: str) -> str:
    """The one TypeError text of forward-mode differentiation through a quantized GEMM, naming the entry point."""
    return (f"{where} supports reverse-mode differentiation only (jax.grad, jax.vjp, jax.jacrev): its gradients are "
            "quantized GEMMs defined by a custom VJP, which has no forward-mode rule (jax.jvp, jax.jacfwd, "
            "jax.hessian, applying jax.linearize's function) and no second derivative. Use jax.jacrev for "
            "Jacobians, or recipes.BF16() for higher-order derivatives")


def refuse_forward_mode(where: str, *args) -> None:
    """TypeError (`forward_mode_message`) when an argument carries a forward-mode tracer. Entry points call it before
    anything else that could fail (key lookups, shape checks of the backward operands), so every recipe, key and
    layer API gives this one error."""
    if jax_compat.forward_mode(args):
        raise TypeError(forward_mode_message(where))


def reverse_mode_only(fn, where: str):
    """`fn` (a custom_vjp function) with forward-mode differentiation refused by `forward_mode_message`: checked on
    the arguments before `fn` runs, and JAX's own forward-mode error translated where the check cannot see it (jax
    without direct linearize, or a forward-mode level outside a jit that `fn` runs in)."""
    def call(*args):
        refuse_forward_mode(where, *args)
        try:
            return fn(*args)
        except TypeError as e:
            if not jax_compat.is_custom_vjp_forward_mode_error(e):
                raise
            raise TypeError(forward_mode_message(where)) from None
    return call
