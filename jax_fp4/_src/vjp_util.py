"""Helpers shared by the custom-VJP GEMMs (`jax_fp4.dense`, `jax_fp4.grouped_gemm`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["dtype_tag", "operand_keys", "reverse_mode_only"]


def operand_keys(key):
    """(x, w, dy) stochastic-rounding keys: `jax.random.split(key, 3)`, or three Nones when `key` is None."""
    if key is None:
        return None, None, None
    return tuple(jax.random.split(key, 3))


def dtype_tag(a):
    """A zero-size array carrying a's dtype (residuals must be arrays, so a pullback can leave jax.jit)."""
    return jnp.zeros((0,), a.dtype)


def _forward_mode(args) -> bool:
    """Whether an argument carries a forward-mode (jax.jvp / jacfwd / hessian's outer) tracer at any level. Reverse
    mode traces with LinearizeTracers (jax's direct linearize, the default); with it off, jax.grad traces with
    JVPTracers too, so nothing is decided here and JAX's own error is translated instead."""
    if not getattr(jax.config, "jax_use_direct_linearize", False):
        return False
    for leaf in jax.tree.leaves(args):
        while isinstance(leaf, jax.core.Tracer):
            kind = type(leaf).__name__
            if kind == "JVPTracer":
                return True
            nxt = getattr(leaf, "primal", None) if kind == "LinearizeTracer" else (
                getattr(leaf, "val", None) if kind == "BatchTracer" else None)
            if nxt is None:
                break
            leaf = nxt
    return False


def reverse_mode_only(fn, where: str):
    """`fn` (a custom_vjp function) with forward-mode differentiation refused by a TypeError that says what to use:
    checked on the arguments before `fn` runs (so every recipe and shape gives the same error, not a shape error of
    the backward operands first), and JAX's own forward-mode error translated where the check cannot see it."""
    msg = (f"{where} supports reverse-mode differentiation only (jax.grad, jax.vjp, jax.jacrev): its gradients are "
           "quantized GEMMs defined by a custom VJP, which has no forward-mode rule (jax.jvp, jax.jacfwd, "
           "jax.hessian) and no second derivative. Use jax.jacrev for Jacobians, or recipes.BF16() for higher-order "
           "derivatives")

    def call(*args):
        if _forward_mode(args):
            raise TypeError(msg)
        try:
            return fn(*args)
        except TypeError as e:
            if "forward-mode" not in str(e) and "jvp" not in str(e):
                raise
            raise TypeError(msg) from None
    return call
