"""The module path of the Flax layer running a jax_fp4 GEMM, for error messages ("blocks/3/mlp/up").

Linen modules know their path (``module.path``). NNX modules do not (a module has no parent link), so the path is
recovered from the Python call stack: the modules whose ``__call__`` (or other method) frames enclose the layer's
call are its ancestors, and the outermost of them that holds the layer in its graph gives the path
(`nnx.iter_graph`, the path `jax_fp4.flax.policy` matches rules against). Used only when raising, never on the
success path.
"""

from __future__ import annotations

import sys

from jax_fp4.policy import path_str

__all__ = ["nnx_path", "linen_path", "calling_layer_path"]


def _frame_modules(limit: int = 64):
    """The first argument (a method's self, whatever its name) of each enclosing frame that is a Flax module (NNX
    or Linen), innermost first."""
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover
        return []
    import flax.linen as nn

    out = []
    frame = sys._getframe(2)
    while frame is not None and len(out) < limit:
        code = frame.f_code
        obj = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None  # a method's self
        if isinstance(obj, (nnx.Module, nn.Module)) and (not out or out[-1] is not obj):
            out.append(obj)
        frame = frame.f_back
    return out


def nnx_path(layer) -> str | None:
    """The "/"-joined path of NNX module `layer` in the outermost enclosing module (from the call stack), or None
    when no enclosing module holds it (a layer called on its own)."""
    from flax import nnx

    best = None
    for mod in _frame_modules():
        if mod is layer or not isinstance(mod, nnx.Module):
            continue
        try:
            for path, node in nnx.iter_graph(mod):
                if node is layer:
                    best = path_str(path)
                    break
        except Exception:  # noqa: BLE001 - a graph that cannot be walked names no path
            continue
    return best


def linen_path(module) -> str | None:
    """A bound Linen module's path ("blocks_3/mlp/up"), or None."""
    try:
        path = module.path
    except Exception:  # noqa: BLE001 - unbound
        return None
    return path_str(path) or None


def calling_layer_path() -> str | None:
    """The path of the innermost Flax module on the call stack (for a drop-in dot_general, the layer calling it):
    Linen via `linen_path`, NNX via `nnx_path`; None when there is none."""
    import flax.linen as nn

    mods = _frame_modules()
    if not mods:
        return None
    inner = mods[0]
    if isinstance(inner, nn.Module):
        return linen_path(inner)
    path = nnx_path(inner)
    return path if path is not None else type(inner).__name__
