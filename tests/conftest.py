"""Shared pytest configuration for jax_fp4.

* Tests marked `gpu` are skipped (with the reason) unless `jax.default_backend() == "gpu"`.
* `rng` fixture: a numpy Generator seeded per test from the session seed (env JAX_FP4_SEED, else random; the seed is
  printed in the header, so a failure can be replayed with JAX_FP4_SEED=<seed>).
"""

from __future__ import annotations

import os
import secrets
import warnings
import zlib

import numpy as np
import pytest

SESSION_SEED = int(os.environ.get("JAX_FP4_SEED", secrets.randbits(32)))


def _gpu_backend_reason() -> str | None:
    """None when a GPU backend is the default, else why gpu tests are skipped."""
    try:
        import jax

        backend = jax.default_backend()
    except Exception as e:  # pragma: no cover - jax itself failed to initialise
        return f"jax failed to initialise: {e}"
    if backend != "gpu":
        return f"needs a CUDA GPU (jax.default_backend() == {backend!r})"
    return None


def pytest_report_header(config):
    import jax

    lines = [f"jax {jax.__version__}, default backend {jax.default_backend()}, JAX_FP4_SEED={SESSION_SEED}"]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import jax_fp4
            from jax_fp4._src import ffi

        lines.append(
            f"jax_fp4 from {os.path.dirname(jax_fp4.__file__)}; HAS_CUDA_KERNELS={ffi.HAS_CUDA_KERNELS}"
            + ("" if ffi.HAS_CUDA_KERNELS else f" ({ffi.import_error()})")
        )
    except Exception as e:  # report, let the tests fail with the details
        lines.append(f"jax_fp4 failed to import: {e!r}")
    return lines


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _gpu_backend_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """Fresh, reproducible per-test random numbers (session seed x test id)."""
    return np.random.default_rng([SESSION_SEED, zlib.crc32(request.node.nodeid.encode())])
