"""tools/dev/ep_scan_probe.py on 2 forced XLA:CPU devices (the probe of scanned expert-parallel MoE layers).

* variant names: every default name parses, the options set the fields they name (quantized dispatch, remat,
  reference kernels, the command-buffer XLA flag), malformed names raise ValueError; a variant's process gets the
  parent's environment with the driver's --xla-flags and the variant's flags appended to XLA_FLAGS;
* the driver, tiny sizes, three variants (bf16 scanned, nvfp4-fwd-mxfp8-bwd scanned and unrolled with quantized
  dispatch), each in its own process: every process exits 0 after its last stage, prints a finite loss and gradient
  norm, and the JSON (--out) holds one record per variant; the scanned programs hold while loops and all-to-alls;
  the scanned and unrolled models start from the same weights (the same sha256) and their losses agree within 1 %
  (not bit for bit: XLA fuses the scanned body and the unrolled blocks differently, as for the harness's
  scanned-vs-unrolled test of examples/lm).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
from _cpu_devices import ROOT

pytest.importorskip("flax")

PROBE = ROOT / "tools" / "dev" / "ep_scan_probe.py"
TINY = ["--d-model", "64", "--hidden", "64", "--experts", "8", "--top-k", "2", "--tokens", "64", "--seq", "16",
        "--steps", "1"]
SCAN, UNROLL = "nvfp4-fwd-mxfp8-bwd-scan-qdispatch", "nvfp4-fwd-mxfp8-bwd-unroll-qdispatch"


def _probe_module():
    spec = importlib.util.spec_from_file_location("ep_scan_probe", PROBE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_variant_names():
    probe = _probe_module()
    for name in probe.DEFAULT_VARIANTS:
        assert probe.parse_variant(name).name == name
    v = probe.parse_variant("nvfp4-fwd-mxfp8-bwd-scan-qdispatch-nocmdbuf-refkernels-remat")
    assert (v.recipe, v.scan, v.quantized_dispatch, v.remat, v.kernels, v.implementation) == (
        "nvfp4-fwd-mxfp8-bwd", True, True, "full", "reference", "xla")
    assert v.xla_flags == "--xla_gpu_enable_command_buffer="
    v = probe.parse_variant("mxfp8-unroll-bf16dispatch-rematq")
    assert (v.recipe, v.scan, v.quantized_dispatch, v.remat, v.kernels, v.xla_flags) == (
        "mxfp8", False, False, "quantized", "ffi", "")
    assert probe.parse_variant("bf16-scan").quantized_dispatch is None
    for bad in ("bf16", "scan-bf16", "bf16-scan-fast", "bf16-scan-remat-remat", "mxfp8-scan-qdispatch-bf16dispatch"):
        with pytest.raises(ValueError):
            probe.parse_variant(bad)


def test_child_env(monkeypatch):
    probe = _probe_module()
    monkeypatch.setenv("XLA_FLAGS", "--a=1")
    monkeypatch.setenv("EP_SCAN_PROBE_TEST", "kept")
    env = probe.child_env(probe.parse_variant("bf16-scan-nocmdbuf"), "--b=2")
    assert env["XLA_FLAGS"] == "--a=1 --b=2 --xla_gpu_enable_command_buffer="
    assert env["EP_SCAN_PROBE_TEST"] == "kept"
    monkeypatch.delenv("XLA_FLAGS")
    assert "XLA_FLAGS" not in probe.child_env(probe.parse_variant("bf16-scan"), "")


def test_driver_on_cpu(tmp_path):
    out = tmp_path / "probe.json"
    base = "--xla_force_host_platform_device_count=2"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=base)
    proc = subprocess.run([sys.executable, "-P", str(PROBE), "--variants", f"bf16-scan,{SCAN},{UNROLL}",
                           "--out", str(out), "--timeout", "300", *TINY], env=env, cwd=ROOT, text=True,
                          capture_output=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    records = {r["name"]: r for r in json.loads(out.read_text())["variants"]}
    assert list(records) == ["bf16-scan", SCAN, UNROLL]
    for name, rec in records.items():
        assert rec["rc"] == 0 and rec["last_stage"] == "done", (name, rec["status"], rec["stderr_tail"])
        assert name in proc.stdout  # its table row
        res = rec["result"]
        assert res["backend"] == "cpu" and res["finite"], (name, res)
        assert math.isfinite(res["loss"]) and math.isfinite(res["grad_norm"]) and res["ms_per_step"] > 0
        assert rec["xla_flags"] == base
        assert res["hlo"]["all_to_all"] > 0
    for name in ("bf16-scan", SCAN):
        assert records[name]["result"]["hlo"]["while"] > 0
    scan, unroll = records[SCAN]["result"], records[UNROLL]["result"]
    assert scan["weights_sha256"] == unroll["weights_sha256"] == records["bf16-scan"]["result"]["weights_sha256"]
    assert math.isclose(scan["loss"], unroll["loss"], rel_tol=1e-2), (scan["loss"], unroll["loss"])
