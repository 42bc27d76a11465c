"""train_lm with mixture-of-experts llama blocks on an expert mesh (examples/lm: lm_moe, lm_mesh's "expert" axis).

* the moe-large preset: ~1.72B parameters, ~0.31B active per token, 64 experts top-8 (the counts of count_params);
* --mesh parsing (DATAxFSDPxTENSORxEXPERT) and the mesh checks (an expert axis needs MoE, the experts must split
  evenly, no tensor axis with MoE, --capacity-factor needs an expert axis);
* on 2 forced CPU devices (a subprocess): nvfp4-fwd-mxfp8-bwd on one device, then on --mesh 1x1x1x2 (experts split,
  quantized dispatch) for 2 steps with --collectives, resumed on --mesh 2x1 (data parallel, experts replicated): the
  compiled step runs 7 all-to-alls (forward: expert ids, x codes, x scales, the combine; backward: dy codes, dy
  scales, dx; none repeated under remat "quantized"), the step-1 loss equals the one-device loss within the float32
  bound of a mean over the tokens in another order, step 2 within 1 %, the loss falls after the resume, the
  per-expert load sums to 1; with tokamax installed, --grouped-gemm tokamax gives the expert-mesh run's losses bit for
  bit (tokamax's XLA implementation on the CPU).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flax")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "lm"))

import lm_model  # noqa: E402
import train_lm  # noqa: E402

FLAGS = ["--preset", "tiny", "--arch", "llama", "--d-model", "128", "--heads", "4", "--kv-heads", "2",
         "--mlp-hidden", "128", "--moe", "4", "--scan", "--remat", "quantized", "--layers", "1", "--batch", "4",
         "--seq", "64", "--lr", "1e-2", "--warmup", "1", "--log-every", "1", "--eval-every", "1000",
         "--eval-batches", "1", "--no-progress", "--recipe", "nvfp4-fwd-mxfp8-bwd", "--steps", "4"]


def test_moe_large_preset():
    m = train_lm.parse_args(["--preset", "moe-large", "--recipe", "bf16"])[1].model
    assert (m.arch, m.moe_experts, m.moe_top_k, m.hidden, m.seq, m.vocab) == ("llama", 64, 8, 512, 2048, 32768)
    assert 1.7e9 < lm_model.count_params(m) < 1.75e9 and 0.3e9 < lm_model.count_params(m, active=True) < 0.32e9
    assert not m.scan_layers  # unrolled, as measured in docs/performance.md


def test_mesh_flags(capsys):
    args = ["--moe", "4", "--arch", "llama", "--mlp-hidden", "256"]
    assert train_lm.parse_args([*args, "--mesh", "1x1"])[1].mesh == (1, 1, 1, 1)
    assert train_lm.parse_args([*args, "--mesh", "1x1x1"])[1].mesh == (1, 1, 1, 1)
    assert train_lm.parse_args(args)[1].model.moe_gemm == "xla"
    assert train_lm.parse_args([*args, "--grouped-gemm", "tokamax"])[1].model.moe_gemm == "tokamax"
    for flags, match in ((["--mesh", "1x1x1x2"], "needs mixture-of-experts"),
                         ([*args[:1], "3", *args[2:], "--mesh", "1x1x1x2"], "do not split over the expert axis"),
                         ([*args, "--mesh", "1x1x2x1"], "no tensor parallelism"),
                         ([*args, "--capacity-factor", "1.25"], "needs an expert axis"),
                         (["--grouped-gemm", "tokamax"], "--grouped-gemm needs --moe")):
        with pytest.raises(SystemExit):
            train_lm.parse_args(flags)
        assert match in capsys.readouterr().err, flags


SCRIPT = r"""
import sys, json
sys.path.insert(0, "examples/lm")
import train_lm
out, flags = sys.argv[1], json.loads(sys.argv[2])
train_lm.main([*flags, "--out", out + "/one"])
train_lm.main([*flags, "--mesh", "1x1x1x2", "--stop-at", "2", "--collectives", "--out", out + "/moved"])
print("COLL " + json.dumps(json.load(open(out + "/moved/summary.json"))["nvfp4-fwd-mxfp8-bwd"]["collectives"]))
try:
    import tokamax  # noqa: F401 - the expert GEMMs by tokamax (its XLA implementation on the CPU): the same bits
    train_lm.main([*flags, "--mesh", "1x1x1x2", "--stop-at", "2", "--grouped-gemm", "tokamax", "--out", out + "/tk"])
except ImportError:
    pass
train_lm.main([*flags, "--mesh", "2x1", "--resume", "--out", out + "/moved"])
"""


def test_expert_mesh_train_and_resume_on_another_expert_axis(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-P", "-c", SCRIPT, str(tmp_path), json.dumps(FLAGS)], cwd=ROOT, env=env,
                          text=True, capture_output=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    assert "mesh: data 1 x fsdp 1 x tensor 1 x expert 2 over 2 devices" in proc.stdout
    assert "nvfp4-fwd-mxfp8-bwd: resumed from" in proc.stdout
    coll = json.loads(next(ln[5:] for ln in proc.stdout.splitlines() if ln.startswith("COLL ")))
    assert coll["all-to-all"]["count_per_step"] == 7 and coll["all-to-all"]["bytes_per_step"] > 0, coll

    def losses(name):
        with (tmp_path / name / "curves.csv").open(newline="") as f:
            return [float(r["train_loss"]) for r in csv.DictReader(f)]

    one, moved = losses("one"), losses("moved")
    if (tmp_path / "tk").exists():
        assert "GEMMs by tokamax" in proc.stdout and losses("tk") == moved[:2], (losses("tk"), moved)
    assert len(one) == len(moved) == 4 and np.all(np.isfinite(moved)), (one, moved)
    n = 4 * 64  # step 1: the same values per token (expert parallel y = MoEMLP's), the mean in another order
    assert abs(moved[0] - one[0]) <= 2 * (n - 1) * 2.0**-24 * one[0], (moved[0], one[0])
    # step 2: after one update whose expert weight gradients used x^ and dy^ (the quantized dispatch); later steps
    # separate further (lr 1e-2 on a tiny model), but keep training
    assert abs(moved[1] - one[1]) <= 1e-2 * one[1] and moved[3] < moved[0] - 2, (one, moved)
    load = json.loads((tmp_path / "moved" / "summary.json").read_text())["nvfp4-fwd-mxfp8-bwd"]["expert_load"]
    assert len(load) == 4 and abs(sum(load) - 1) < 1e-6, load
