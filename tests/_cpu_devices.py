"""Run a script on forced XLA:CPU devices in a subprocess (XLA_FLAGS must be set before the backend starts) and
collect the JSON objects it prints on lines starting with "RESULT "."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_results(script: str, devices: int, args=(), dump=None, timeout: int = 600) -> list:
    """The RESULT objects of `python -P -c script *args` run from the repository root with JAX_PLATFORMS=cpu and
    `devices` forced host devices; dump: a directory for XLA's HLO after SPMD partitioning
    (`--xla_dump_hlo_pass_re=spmd-partitioning`), or None. Fails the calling test with the script's output tails when
    it exits non-zero."""
    flags = f"--xla_force_host_platform_device_count={devices}"
    if dump is not None:
        flags += f" --xla_dump_to={dump} --xla_dump_hlo_pass_re=spmd-partitioning"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    proc = subprocess.run([sys.executable, "-P", "-c", script, *map(str, args)], env=env, cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-6000:])
    return [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
