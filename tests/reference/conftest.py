"""Configuration of the CPU test suite of the reference (`jax_fp4.reference` and the public API running on it).

The suite runs on the CPU backend (the reference is the CPU lowering of every primitive). Fixtures: `rng` comes
from tests/conftest.py (session seed in the pytest header; replay with JAX_FP4_SEED=<seed>).
"""

from __future__ import annotations

import warnings

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import jax_fp4  # noqa: F401


@pytest.fixture(autouse=True)
def _no_reference_only_warning():
    """The reference-only warning is expected on CPU; keep it out of every test's warning report."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=jax_fp4.ReferenceOnlyWarning)
        yield
