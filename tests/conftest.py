"""Shared pytest configuration for jax_fp4.

* Tests marked `gpu` are skipped (with the reason) unless `jax.default_backend() == "gpu"`.
* `rng` fixture: a numpy Generator seeded per test from the session seed (env JAX_FP4_SEED, else random; the seed is
  printed in the header, so a failure can be replayed with JAX_FP4_SEED=<seed>).
* Tests marked `gpu` run with the primitives lowered to the jnp reference on the CPU device, so their CPU-side
  expectations come from `jax_fp4.reference`, not from the CPU extension's host handlers.
* The suite runs in parallel worker processes (pytest-xdist, `-n auto` in pyproject.toml): the controller draws the
  run's seed and hands it to every worker, so each test's inputs depend only on the seed and its id, whichever
  worker runs it. Workers allocate GPU memory on demand (several processes share one GPU).
* The quick tier (`-m "not gpu and not slow"`) leaves `QUICK_TIER_LEAVES_OUT` to the full suite and, without a
  CUDA plugin, compiles at LLVM -O0 (`_quick_tier_at_o0`).
"""

from __future__ import annotations

import os
import secrets
import warnings
import zlib

import numpy as np
import pytest

SESSION_SEED = int(os.environ.get("JAX_FP4_SEED", secrets.randbits(32)))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Set before any test module imports jax: XLA's default preallocation (75 % of the GPU per process) would leave
    # nothing for the other workers.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _quick_tier_at_o0(config) -> bool:
    """README's quick tier (`-m "not gpu and not slow"`) on a machine without JAX's CUDA plugin has XLA compile at LLVM
    -O0 (`--xla_backend_optimization_level=0`, appended to XLA_FLAGS unless they set a level): compiling the bit-exact
    reference is most of the tier's time, and -O0 takes about a quarter of it off (measured on 2 cores). IEEE results do
    not depend on the LLVM optimisation level (XLA:CPU compiles without fast-math); the full suite, which CI runs,
    keeps XLA's default level."""
    import importlib.util

    if "not slow" not in (config.option.markexpr or ""):
        return False
    if any(importlib.util.find_spec(m) for m in ("jax_cuda13_plugin", "jax_cuda12_plugin")):
        return False
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()
    return True


def pytest_configure(config):
    global SESSION_SEED
    config.jax_fp4_quick_o0 = _quick_tier_at_o0(config)  # before any test module imports jax
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # an xdist worker: the controller's seed
        SESSION_SEED = int(workerinput["jax_fp4_seed"])


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist controller hook: every worker uses the controller's seed."""
    node.workerinput["jax_fp4_seed"] = SESSION_SEED


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
    if getattr(config, "jax_fp4_quick_o0", False):
        lines.append("quick tier: XLA compiles at --xla_backend_optimization_level=0 (tests/conftest.py)")
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


#: Parametrizations the quick tier (`-m "not slow"`, README's CPU quick start) leaves to the full suite: each the
#: costliest instance of a test that the quick tier still runs with its other parameters, or a single test whose
#: subject the quick tier covers elsewhere (NaN propagation, grouped SR streams). XLA:CPU compiling the bit-exact
#: reference takes most of their time (8-35 s each on 2 cores). Ids as pytest writes them, file::test[params].
QUICK_TIER_LEAVES_OUT = frozenset({
    "test_cpu_dequantize.py::test_dequantize[NVFP4()-swizzled]",
    "test_cpu_dequantize.py::test_dequantize[NVFP4(local_1x64=True)-swizzled]",
    "test_cpu_dequantize.py::test_dequantize[NVFP4(rht=True)-swizzled]",
    "test_cpu_grouped.py::test_dequantize_random_codes[NVFP4()-axis0]",
    "test_cpu_grouped.py::test_dequantize_random_codes[NVFP4(rht=True)-axis-1]",
    "test_cpu_grouped.py::test_dequantize_random_codes[NVFP4(rht=True)-axis0]",
    "test_cpu_grouped.py::test_public_grouped_ops[VARYING_FIRST_DIM]",
    "test_cpu_grouped.py::test_quantize_given_amax_and_sr_streams",
    "test_cpu_grouped.py::test_quantize_misaligned_groups[4-NVFP4(rht=True, stochastic_rounding=True)-"
    "MXFP8(element='e5m2')]",
    "test_cpu_kernels.py::test_edge_values[NVFP4(scaling_2d=True)-NVFP4(rht=True)]",
    "test_cpu_kernels.py::test_exact_operands[NVFP4()-MXFP8()]",
    "test_cpu_kernels.py::test_exact_operands[NVFP4()-NVFP4(rht=True)]",
    "test_cpu_kernels.py::test_exact_operands[NVFP4(scaling_2d=True)-NVFP4(scaling_2d=True)]",
    "test_cpu_kernels.py::test_exact_operands[NVFP4(stochastic_rounding=True)-NVFP4(stochastic_rounding=True)]",
    "test_cpu_kernels.py::test_pairs[NVFP4()-NVFP4(rht=True)-compact]",
    "test_cpu_kernels.py::test_shapes[NVFP4(rht=True)-NVFP4(rht=True)-(3, 48, 32)]",
    "test_nonfinite_and_ranges.py::test_mxfp8_largest_finite_values_decode_finite[MXFP8()-float16]",
    "test_nonfinite_and_ranges.py::test_nan_reaches_the_grouped_gemm_output",
    "test_nonfinite_and_ranges.py::test_nan_visible_through_1x64[0]",
})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.rsplit("/", 1)[-1] in QUICK_TIER_LEAVES_OUT:
            item.add_marker(pytest.mark.slow)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _gpu_backend_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_tests_against_the_reference(request):
    """GPU tests compare the CUDA kernels with computations on the CPU device: inside them the primitives lower to the
    jnp reference on the CPU (`ffi.reference_lowering_on_cpu`), not to the host handlers of the CPU extension, so the
    oracle of every kernel test stays `jax_fp4.reference`."""
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    from jax_fp4._src import ffi

    with ffi.reference_lowering_on_cpu():
        yield


@pytest.fixture
def rng(request) -> np.random.Generator:
    """Fresh, reproducible per-test random numbers (session seed x test id)."""
    return np.random.default_rng([SESSION_SEED, zlib.crc32(request.node.nodeid.encode())])
