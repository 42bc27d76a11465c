"""benchmarks/dense.py runs on the CPU (small shape, one recipe), with and without --no-bias, and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocesses: full suite only (the quick tier stays within README's minutes)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("no_bias", [False, True])
def test_dense_benchmark_writes_rows(tmp_path, no_bias):
    out = tmp_path / "dense.json"
    cmd = [sys.executable, "-P", str(ROOT / "benchmarks" / "dense.py"), "--shapes", "small", "--recipes",
           "nvfp4-fwd-mxfp8-bwd", "--iters", "1", "--repeats", "1", "--out", str(out)]
    cmd += ["--no-bias"] if no_bias else []
    proc = subprocess.run(cmd, cwd=tmp_path, text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["bias"] is (not no_bias)
    rows = {r["recipe"]: r for r in res["rows"]}
    assert set(rows) == {"bf16", "nvfp4-fwd-mxfp8-bwd"}
    for r in rows.values():
        assert "error" not in r and r["ms"] > 0 and r["residual_bytes"] > 0, r
    assert rows["nvfp4-fwd-mxfp8-bwd"]["floor_ms"] > 0
    assert ("+ dbias" in proc.stdout) is (not no_bias)
