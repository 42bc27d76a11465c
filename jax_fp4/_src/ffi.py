"""Loading and registering the CUDA extension `jax_fp4._jax_fp4_cuda`.

Importing this module tries to import the extension. When it is present, every FFI handler it exports
(`registrations()`: target name -> PyCapsule) is registered with `jax.ffi.register_ffi_target(..., platform="CUDA")`
exactly once, and the primitives add their CUDA lowerings. When it is absent (the wheel was built without a CUDA
compiler, or with JAX_FP4_CUDA=OFF), one `ReferenceOnlyWarning` is emitted and every primitive lowers to the pure-JAX
reference on every platform: results are the same bits, only slower on GPU.

This module imports only jax and the extension (no other jax_fp4 module), so any layer may import it.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from types import ModuleType

import jax

__all__ = ["HAS_CUDA_KERNELS", "ReferenceOnlyWarning", "ensure_registered", "extension", "import_error", "targets"]


class ReferenceOnlyWarning(UserWarning):
    """The CUDA extension is not available; jax_fp4 runs on the pure-JAX reference everywhere."""


def _load() -> tuple[ModuleType | None, BaseException | None]:
    try:
        return importlib.import_module("jax_fp4._jax_fp4_cuda"), None
    except ImportError as e:  # not built, or built for another Python / platform
        return None, e


_EXT, _IMPORT_ERROR = _load()

#: True when the CUDA extension imported; the CUDA lowerings are then registered for platform "cuda".
HAS_CUDA_KERNELS: bool = _EXT is not None

_lock = threading.Lock()
_registered: tuple[str, ...] | None = None


def extension() -> ModuleType | None:
    """The loaded extension module, or None."""
    return _EXT


def import_error() -> BaseException | None:
    """Why the extension did not import (None when it did)."""
    return _IMPORT_ERROR


def ensure_registered() -> bool:
    """Register every FFI target of the extension for platform CUDA (idempotent, thread-safe).

    Returns:
      True when the extension is present (its targets are registered), False otherwise.
    """
    global _registered
    if _EXT is None:
        return False
    with _lock:
        if _registered is None:
            regs = _EXT.registrations()
            for name, capsule in regs.items():
                jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
            _registered = tuple(sorted(regs))
    return True


def targets() -> tuple[str, ...]:
    """Names of the registered FFI targets (empty without the extension)."""
    ensure_registered()
    return _registered or ()


if HAS_CUDA_KERNELS:
    ensure_registered()
else:
    warnings.warn(
        "jax_fp4: the CUDA extension jax_fp4._jax_fp4_cuda is not available "
        f"({_IMPORT_ERROR}); jax_fp4 runs on its pure-JAX reference implementation on every platform "
        "(same results, no custom CUDA kernels). Reinstall with a CUDA compiler (nvcc) on PATH to build them.",
        ReferenceOnlyWarning,
        stacklevel=2,
    )
