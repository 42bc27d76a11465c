"""jax_fp4 CUDA kernels as XLA FFI handlers (present only when built with a CUDA compiler)."""

from typing import Any

def registrations() -> dict[str, Any]:
    """Return {target_name: PyCapsule} for every FFI handler; register with platform="CUDA"."""

#: The architectures the kernels were compiled for, e.g. ("sm_90a", "sm_100a", "compute_90") (PTX: compute_*).
cuda_architectures: tuple[str, ...]
#: The version of the CUDA compiler that built the extension (CMake's CMAKE_CUDA_COMPILER_VERSION), e.g. "13.0.88".
cuda_compiler_version: str
