"""Helpers shared by the custom-VJP GEMMs (`jax_fp4.dense`, `jax_fp4.grouped_gemm`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["dtype_tag", "operand_keys"]


def operand_keys(key):
    """(x, w, dy) stochastic-rounding keys: `jax.random.split(key, 3)`, or three Nones when `key` is None."""
    if key is None:
        return None, None, None
    return tuple(jax.random.split(key, 3))


def dtype_tag(a):
    """A zero-size array carrying a's dtype (residuals must be arrays, so a pullback can leave jax.jit)."""
    return jnp.zeros((0,), a.dtype)
