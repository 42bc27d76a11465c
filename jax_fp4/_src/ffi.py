"""Loading and registering the extensions `jax_fp4._jax_fp4_cuda` and `jax_fp4._jax_fp4_cpu`.

Importing this module tries to import both. When the CUDA extension is present, every FFI handler it exports
(`registrations()`: target name -> PyCapsule) is registered with `jax.ffi.register_ffi_target(..., platform="CUDA")`
exactly once, and the primitives add their CUDA lowerings. When it is absent (the wheel was built without a CUDA
compiler, or with JAX_FP4_CUDA=OFF), one `ReferenceOnlyWarning` is emitted and the primitives lower to the pure-JAX
reference on GPUs: results are the same bits, only slower.

The CPU extension (cpp/cpu/, built by the host C++ compiler with every wheel) holds host handlers for some targets
under the same names; they are registered for platform "cpu" (`ensure_cpu_registered`, `cpu_targets`) and the
primitives lower to them on the CPU. Without it (a source checkout imported directly) the CPU runs the reference.

This module imports only jax and the extension (no other jax_fp4 module), so any layer may import it.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import warnings
from types import ModuleType

import jax

__all__ = ["HAS_CPU_KERNELS", "HAS_CUDA_KERNELS", "ReferenceOnlyWarning", "cpu_import_error", "cpu_rule", "cpu_targets",
           "ensure_cpu_registered", "ensure_registered", "extension", "import_error", "reference_lowering_on_cpu",
           "targets"]


class ReferenceOnlyWarning(UserWarning):
    """The CUDA extension is not available; jax_fp4 runs on the pure-JAX reference everywhere."""


def _load(name: str = "jax_fp4._jax_fp4_cuda") -> tuple[ModuleType | None, BaseException | None]:
    try:
        return importlib.import_module(name), None
    except ImportError as e:  # not built, or built for another Python / platform
        return None, e


_EXT, _IMPORT_ERROR = _load()
_CPU_EXT, _CPU_IMPORT_ERROR = _load("jax_fp4._jax_fp4_cpu")

#: True when the CUDA extension imported; the CUDA lowerings are then registered for platform "cuda".
HAS_CUDA_KERNELS: bool = _EXT is not None
#: True when the CPU extension imported; its targets are then registered for platform "cpu".
HAS_CPU_KERNELS: bool = _CPU_EXT is not None

_lock = threading.Lock()


def extension() -> ModuleType | None:
    """The loaded extension module, or None."""
    return _EXT


def import_error() -> BaseException | None:
    """Why the extension did not import (None when it did)."""
    return _IMPORT_ERROR


_registered: dict[str, tuple[str, ...]] = {}  # platform -> the targets registered for it


def _register(ext: ModuleType | None, platform: str) -> bool:
    """Register every FFI target of `ext` for `platform` once (thread-safe); False when `ext` did not import."""
    if ext is None:
        return False
    with _lock:
        if platform not in _registered:
            regs = ext.registrations()
            for name, capsule in regs.items():
                jax.ffi.register_ffi_target(name, capsule, platform=platform)
            _registered[platform] = tuple(sorted(regs))
    return True


def ensure_registered() -> bool:
    """Register every FFI target of the extension for platform CUDA (idempotent, thread-safe).

    Returns:
      True when the extension is present (its targets are registered), False otherwise.
    """
    return _register(_EXT, "CUDA")


def targets() -> tuple[str, ...]:
    """Names of the registered FFI targets (empty without the extension)."""
    ensure_registered()
    return _registered.get("CUDA", ())


def ensure_cpu_registered() -> bool:
    """Register every FFI target of the CPU extension for platform "cpu" (idempotent, thread-safe).

    Returns:
      True when the CPU extension is present (its targets are registered), False otherwise.
    """
    return _register(_CPU_EXT, "cpu")


def cpu_targets() -> tuple[str, ...]:
    """Names of the FFI targets registered for the CPU (empty without the CPU extension)."""
    ensure_cpu_registered()
    return _registered.get("cpu", ())


_reference_on_cpu = 0  # depth of reference_lowering_on_cpu() contexts


@contextlib.contextmanager
def reference_lowering_on_cpu():
    """Within this context the primitives lower to the jnp reference on the CPU even where the CPU extension is built.

    It is the oracle of the GPU tests (the CUDA kernels against `jax_fp4.reference`, not against the host handlers)
    and of `tools/golden/make.py`. jax's compilation caches are cleared on entry and on exit, so no executable
    lowered on one side of the boundary runs on the other. Not thread-safe: meant for tests and tools.
    """
    global _reference_on_cpu
    jax.clear_caches()
    _reference_on_cpu += 1
    try:
        yield
    finally:
        _reference_on_cpu -= 1
        jax.clear_caches()


def cpu_rule(kernel_rule, reference_rule):
    """The lowering rule a primitive registers for platform "cpu": `kernel_rule` (the host handler), or
    `reference_rule` inside `reference_lowering_on_cpu()`."""
    def rule(ctx, *args, **params):
        return (reference_rule if _reference_on_cpu else kernel_rule)(ctx, *args, **params)
    return rule


def cpu_import_error() -> BaseException | None:
    """Why the CPU extension did not import (None when it did)."""
    return _CPU_IMPORT_ERROR


ensure_cpu_registered()
if HAS_CUDA_KERNELS:
    ensure_registered()
else:
    warnings.warn(
        "jax_fp4: the CUDA extension jax_fp4._jax_fp4_cuda is not available "
        f"({_IMPORT_ERROR}); jax_fp4 runs on its pure-JAX reference implementation on GPUs "
        f"(same results, no custom CUDA kernels; CPU kernels: {HAS_CPU_KERNELS}). Reinstall with a CUDA compiler "
        "(nvcc) on PATH to build them.",
        ReferenceOnlyWarning,
        stacklevel=2,
    )
