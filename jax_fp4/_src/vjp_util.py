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


def reverse_mode_only(fn, where: str):
    """`fn` (a custom_vjp function) with JAX's forward-mode error replaced by a TypeError that says what to use."""
    def call(*args):
        try:
            return fn(*args)
        except TypeError as e:
            if "forward-mode" not in str(e) and "jvp" not in str(e):
                raise
            raise TypeError(f"{where} supports reverse-mode differentiation only (jax.grad, jax.vjp, jax.jacrev): "
                            "its gradients are quantized GEMMs defined by a custom VJP, which has no forward-mode "
                            "rule (jax.jvp, jax.jacfwd, jax.hessian) and no second derivative. Use jax.jacrev for "
                            "Jacobians, or recipes.BF16() for higher-order derivatives") from None
    return call
