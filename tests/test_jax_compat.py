"""Every JAX / Flax internal jax_fp4 reads (`jax_fp4._src.jax_compat`) checked against the installed versions: a jax
or flax release that renames a tracer class, rewords the custom_vjp forward-mode error, moves Linen's module context
or drops a primitive hook fails here, by name, instead of silently changing what the package does."""

from __future__ import annotations

import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.extend.core import Primitive

from jax_fp4._src import jax_compat

X = jnp.ones((4,), jnp.float32)


def _seen(transform):
    """(tracer_kind, autodiff_mode, forward_mode) of the argument inside `transform`."""
    out = {}

    def f(x):
        out["v"] = (jax_compat.tracer_kind(x), jax_compat.autodiff_mode(x), jax_compat.forward_mode(x))
        return jnp.sum(x)

    transform(f)
    return out["v"]


def test_tracer_classes_exist_under_their_names():
    modules = {"JVPTracer": "jax._src.interpreters.ad", "LinearizeTracer": "jax._src.interpreters.ad",
               "BatchTracer": "jax._src.interpreters.batching"}
    assert set(modules) == set(jax_compat.TRACER_KINDS)
    for name, module in modules.items():
        cls = getattr(importlib.import_module(module), name, None)
        assert isinstance(cls, type) and issubclass(cls, jax.core.Tracer), f"jax has no {module}.{name}"


def test_direct_linearize_is_on():
    assert hasattr(jax.config, "jax_use_direct_linearize"), "jax dropped the jax_use_direct_linearize flag"
    assert jax_compat.direct_linearize()


@pytest.mark.parametrize("name, transform, want", [
    ("eager", lambda f: f(X), (None, None, False)),
    ("grad", lambda f: jax.grad(f)(X), ("linearize", "reverse", False)),
    ("vjp", lambda f: jax.vjp(f, X), ("linearize", "reverse", False)),
    ("jvp", lambda f: jax.jvp(f, (X,), (X,)), ("jvp", "forward", True)),
    ("jacfwd", lambda f: jax.jacfwd(f)(X), ("jvp", "forward", True)),
    ("jit", lambda f: jax.jit(f)(X), ("other", "unknown", False)),
    ("vmap", lambda f: jax.vmap(f)(X[None]), ("batch", None, False)),
    ("vmap of grad", lambda f: jax.vmap(jax.grad(f))(X[None]), ("linearize", "reverse", False)),
    ("grad of vmap", lambda f: jax.grad(lambda x: jnp.sum(jax.vmap(f)(x)))(X[None]), ("batch", "reverse", False)),
    ("jvp of grad", lambda f: jax.jvp(jax.grad(f), (X,), (X,)), ("linearize", "reverse", True)),
])
def test_tracer_kinds_under_each_transform(name, transform, want):
    assert _seen(transform) == want, name


def test_custom_vjp_forward_mode_error_text():
    @jax.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, None), lambda _, g: (g,))
    with pytest.raises(TypeError) as e:
        jax.jvp(f, (X,), (X,))
    assert jax_compat.is_custom_vjp_forward_mode_error(e.value), f"jax reworded it: {e.value}"
    assert not jax_compat.is_custom_vjp_forward_mode_error(TypeError("unrelated"))


def test_current_linen_module():
    seen = []

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            seen.append(jax_compat.current_linen_module())
            return x

    module = M()
    module.apply({}, X)
    assert jax_compat.current_linen_module() is None
    assert len(seen) == 1 and isinstance(seen[0], M), "flax.linen.module._context.module_stack moved"


def test_primitive_hooks():
    assert callable(jax_compat.apply_primitive()), "jax.interpreters.xla.apply_primitive is gone"
    assert jax_compat.require_devices_during_lowering(Primitive("jax_compat_probe")), \
        "jax._src.dispatch.prim_requires_devices_during_lowering is gone"
