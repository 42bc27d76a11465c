"""XLA command buffers (CUDA graphs) around the jf4_* custom calls, shared by tests/test_quantize_kernels.py and
tests/test_dequantize_kernels.py (GPU only).

XLA_FLAGS is read when the backend starts, so the workload runs in a subprocess with the command-buffer flags; its
output hashes are compared with the CPU reference's in this process.

Imported as a top-level module: pytest's default "prepend" import mode puts tests/ (no __init__.py) on sys.path.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import jax
import pytest
from _quantize_util import bits_hash

import jax_fp4

CMD_BUFFER_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"

_SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    sys.path.insert(0, {tests_dir!r})
    warnings.simplefilter("ignore")
    import jax
    from _quantize_util import bits_hash
    from {make_args.__module__} import {make_args.__name__} as make_args
    from {workload.__module__} import {workload.__name__} as workload
    assert jax.default_backend() == "gpu", jax.default_backend()
    fj = jax.jit(workload)
    args = jax.device_put(make_args({seed}), jax.devices("gpu")[0])
    text = fj.lower(args).as_text()
    missing = [t for t in {custom_calls!r} if "custom_call @" + t not in text]
    assert not missing, "no custom call " + repr(missing) + " in:\\n" + text[:3000]
    print("HASHES", *[bits_hash(jax.block_until_ready(fj(args))) for _ in range({runs})])
    """
)


def assert_command_buffer_runs(make_args, workload, seed: int, custom_calls: tuple[str, ...], runs: int = 3,
                               expected: str | None = None):
    """jit(workload)(make_args(seed)) `runs` times on the GPU in a subprocess with XLA command buffers capturing the
    custom calls (CMD_BUFFER_FLAGS added to XLA_FLAGS); each run's bits must equal the CPU reference's, or
    `expected` (a `bits_hash`, e.g. of the same workload run on the GPU without command buffers, for targets with
    no CPU lowering).

    make_args / workload: module-level functions of an importable module under tests/ (the subprocess imports them by
    name); the lowering must hold a custom call to each of `custom_calls`. xfails when this jaxlib rejects the flags.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(jax_fp4.__file__)))
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + CMD_BUFFER_FLAGS).strip(),
               PYTHONPATH=os.pathsep.join([root, tests_dir, os.environ.get("PYTHONPATH", "")]))
    code = _SCRIPT.format(tests_dir=tests_dir, make_args=make_args, workload=workload, seed=seed,
                          custom_calls=tuple(custom_calls), runs=runs)
    res = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        err = res.stderr[-4000:]
        if re.search(r"Unknown flags? in XLA_FLAGS|(?i:unknown|invalid|illegal|unrecognized|failed to parse|bad value)"
                     r".{0,200}(xla_gpu_enable_command_buffer|xla_gpu_graph_min_graph_size|CUSTOM_CALL)", err):
            pytest.xfail(f"this jaxlib rejects the command-buffer flags {CMD_BUFFER_FLAGS!r}:\n{err}")
        pytest.fail(f"command-buffer subprocess failed (rc {res.returncode}):\n{res.stdout[-2000:]}\n{err}")
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("HASHES")]
    assert lines, res.stdout + res.stderr[-4000:]
    hashes = lines[-1].split()[1:]
    if expected is None:
        cpu = jax.devices("cpu")[0]
        expected = bits_hash(jax.device_get(jax.jit(workload)(jax.device_put(make_args(seed), cpu))))
    assert hashes == [expected] * runs, f"command-buffer runs {hashes} vs {expected}"
