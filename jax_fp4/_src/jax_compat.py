"""Every use of a JAX or Flax internal in jax_fp4, behind one named function each (jax 0.10.2 to 0.12, flax 0.12).

The package reads a few things that neither JAX nor Flax exports as API: which kind of tracer an argument carries
(to tell a differentiated call from a forward-only one, and forward mode from reverse mode), the text of JAX's
forward-mode error for custom-VJP functions, the Linen module whose method is running, and two hooks of the
primitive machinery. Each is read here and nowhere else; tests/test_jax_compat.py checks each against the installed
jax / flax, so a release that renames a tracer class, rewords the error or moves the Linen context fails there,
loudly, instead of silently changing what the package does.
"""

from __future__ import annotations

import jax

__all__ = ["TRACER_KINDS", "tracer_kind", "tracer_inner", "direct_linearize", "autodiff_mode", "forward_mode",
           "is_custom_vjp_forward_mode_error", "current_linen_module", "apply_primitive",
           "require_devices_during_lowering"]

#: The tracer class names read by `tracer_kind` (jax.interpreters.ad.JVPTracer / LinearizeTracer,
#: jax.interpreters.batching.BatchTracer); a test checks that jax still defines each.
TRACER_KINDS = {"JVPTracer": "jvp", "LinearizeTracer": "linearize", "BatchTracer": "batch"}


def tracer_kind(x) -> str | None:
    """"jvp" (forward mode: jax.jvp, jacfwd; also jax.grad without direct linearize), "linearize" (reverse mode:
    jax.grad / vjp / linearize with direct linearize, jax's default), "batch" (jax.vmap), "other" (another tracer:
    jit, scan, ...) or None (not a tracer)."""
    if not isinstance(x, jax.core.Tracer):
        return None
    return TRACER_KINDS.get(type(x).__name__, "other")


def tracer_inner(x):
    """The value one level below a tracer of kind "linearize" (its primal) or "batch" (its batched value), else
    None: the next tracer (or array) `autodiff_mode` looks at."""
    kind = tracer_kind(x)
    if kind == "linearize":
        return getattr(x, "primal", None)
    if kind == "batch":
        return getattr(x, "val", None)
    return None


def direct_linearize() -> bool:
    """Whether jax.grad traces with LinearizeTracers (the jax_use_direct_linearize flag, on by default since
    jax 0.7): only then can a JVPTracer be told to mean forward mode."""
    return bool(getattr(jax.config, "jax_use_direct_linearize", False))


def autodiff_mode(tree) -> str | None:
    """How a call on `tree` (arrays / pytrees) is being differentiated, from its leaves' tracers: "forward" (a JVPTracer
    under direct linearize: jax.jvp, jax.jacfwd, hessian's outer level), "reverse" (a LinearizeTracer; a JVPTracer
    when direct linearize is off), None when no leaf is traced at all (an eager call), "unknown" when traced only by
    something else (jax.jit / nnx.jit / scan, which may sit inside a grad). vmap levels are looked through."""
    unknown = False
    for leaf in jax.tree.leaves(tree):
        while True:
            kind = tracer_kind(leaf)
            if kind is None:
                break
            if kind == "jvp":
                return "forward" if direct_linearize() else "reverse"
            if kind == "linearize":
                return "reverse"
            nxt = tracer_inner(leaf)
            if nxt is None:
                unknown = True
                break
            leaf = nxt
    return "unknown" if unknown else None


def forward_mode(tree) -> bool:
    """Whether some leaf of `tree` carries a forward-mode tracer at any level (looked through linearize and vmap
    levels; `autodiff_mode` stops at the first differentiating level)."""
    if not direct_linearize():
        return False
    for leaf in jax.tree.leaves(tree):
        while tracer_kind(leaf) is not None:
            if tracer_kind(leaf) == "jvp":
                return True
            leaf = tracer_inner(leaf)
    return False


#: Fragments of the TypeError jax raises when jax.jvp meets a custom_vjp function ("can't apply forward-mode
#: autodiff (jvp) to a custom_vjp function.", jax 0.10 to 0.12).
CUSTOM_VJP_JVP_ERROR = ("forward-mode", "custom_vjp")


def is_custom_vjp_forward_mode_error(e: BaseException) -> bool:
    """Whether `e` is jax's TypeError for forward-mode differentiation of a custom_vjp function."""
    return isinstance(e, TypeError) and all(s in str(e) for s in CUSTOM_VJP_JVP_ERROR)


def current_linen_module():
    """The innermost Linen module whose method is running (flax.linen.module._context.module_stack), or None (no
    Linen module, or a flax without Linen)."""
    try:
        from flax.linen.module import _context
    except ImportError:  # pragma: no cover - a flax without Linen's module context
        return None
    stack = getattr(_context, "module_stack", None)
    return stack[-1] if stack else None


def apply_primitive():
    """jax's eager rule that compiles one primitive alone (jax.interpreters.xla.apply_primitive), or None."""
    try:
        from jax.interpreters.xla import apply_primitive as fn
    except ImportError:  # pragma: no cover - a jax that drops it
        return None
    return fn


def require_devices_during_lowering(prim) -> bool:
    """Make jit pass the device assignment when lowering a jaxpr holding `prim` (as it does for custom_partitioning:
    jax._src.dispatch.prim_requires_devices_during_lowering). False when the hook is missing."""
    try:
        from jax._src import dispatch
        dispatch.prim_requires_devices_during_lowering.add(prim)
    except (ImportError, AttributeError):  # pragma: no cover - a jax without it
        return False
    return True
