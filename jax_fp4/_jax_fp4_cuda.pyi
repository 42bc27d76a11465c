"""jax_fp4 CUDA kernels as XLA FFI handlers (present only when built with a CUDA compiler)."""

from typing import Any

def registrations() -> dict[str, Any]:
    """Return {target_name: PyCapsule} for every FFI handler; register with platform="CUDA"."""
