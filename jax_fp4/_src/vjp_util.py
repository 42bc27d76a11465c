"""Helpers shared by the custom-VJP GEMMs (`jax_fp4.dense`, `jax_fp4.grouped_gemm`) and the layers that call them."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jax_fp4._src import jax_compat

__all__ = ["DtypeTag", "dtype_tag", "operand_keys", "forward_mode_message", "refuse_forward_mode", "reverse_mode_only"]


def operand_keys(key):
    """(x, w, dy) stochastic-rounding keys: `jax.random.split(key, 3)`, or three Nones when `key` is None."""
    if key is None:
        return None, None, None
    return tuple(jax.random.split(key, 3))


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DtypeTag:
    """A custom VJP residual carrying a primal's dtype (`DtypeTag.dtype`, as an array's) and no array: a pytree node
    without leaves, so a pullback can leave jax.jit, and no zero-size array crosses a `jax.shard_map` or scan boundary
    as a residual (see `jax_fp4._src.primitives._common.empty_operand`)."""

    dtype: np.dtype


def dtype_tag(a) -> DtypeTag:
    """The residual carrying a's dtype."""
    return DtypeTag(np.dtype(a.dtype))


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
