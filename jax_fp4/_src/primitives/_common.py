"""Helpers shared by the primitive modules: the eager `impl` rule and the FFI-or-reference lowering switch."""

from __future__ import annotations

from functools import partial

import jax


def def_impl(prim) -> None:
    """Eager rule: compile the primitive alone (jax.interpreters.xla.apply_primitive on jax 0.10-0.12)."""
    try:
        from jax.interpreters.xla import apply_primitive
    except ImportError:  # pragma: no cover - a jax that drops it
        apply_primitive = None
    if apply_primitive is not None:
        prim.def_impl(partial(apply_primitive, prim))
    else:  # pragma: no cover
        prim.def_impl(lambda *args, **params: jax.jit(partial(prim.bind, **params))(*args))
