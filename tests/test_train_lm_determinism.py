"""train_lm --deterministic: two runs of one configuration give the same losses and model bits, and a run stopped,
checkpointed and resumed gives the bits of a straight run.

* CPU (forced host devices, a subprocess): bf16 data parallel (2x1x1, unscanned), nvfp4-fwd-mxfp8-bwd fsdp (1x2x1,
  scanned, remat quantized) and nvfp4 (stochastic rounding and RHT) tensor parallel (1x1x2, remat full);
* GPU (`gpu` marker): the Llama block, 20 steps, bf16, nvfp4-fwd-mxfp8-bwd and nvfp4, 10 steps + checkpoint + 10
  resumed = 20 straight: on the 2-GPU fsdp mesh with XLA's attention (cuDNN's is the case XLA aborts on under
  deterministic ops there), and on one GPU with cuDNN's fused attention (`--attention cudnn`); with cuDNN's attention
  also two unrolled blocks and a scanned stack of two segments, which compile only with distinct attention windows.
Each compares the logged train losses, the validation losses and `summary["model_sha256"]` (the parameters and rng
streams, `jax_fp4.determinism.checksum`) exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _cpu_devices import run_results

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import csv, json, sys
sys.path.insert(0, "examples/lm")
import train_lm
out, base, configs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
def curve(d):
    with open(d + "/curves.csv", newline="") as f:
        return [(r["step"], r["train_loss"], r["val_loss"]) for r in csv.DictReader(f)]
for name, flags in configs.items():
    res = {}
    half = str(int(base[base.index("--steps") + 1]) // 2)
    for run, extra in (("a", []), ("b", []), ("c", ["--stop-at", half]), ("c", ["--resume"])):
        argv = [*base, *flags, "--out", f"{out}/{name}/{run}", *extra]
        s = next(iter(train_lm.main(argv).values()))
        res[run] = {"sha": s["model_sha256"], "val": s["val_loss"], "se": s["val_loss_se"],
                    "curve": curve(f"{out}/{name}/{run}")}
    print("RESULT " + json.dumps({"name": name, **res}), flush=True)
"""

BASE = ["--preset", "tiny", "--layers", "1", "--batch", "8", "--seq", "32", "--steps", "4", "--eval-every", "2",
        "--eval-batches", "1", "--log-every", "1", "--no-progress", "--deterministic", "--seeds", "0"]
CPU_CONFIGS = {
    "bf16": ["--recipe", "bf16", "--mesh", "2x1x1"],
    "nvfp4-fwd-mxfp8-bwd": ["--recipe", "nvfp4-fwd-mxfp8-bwd", "--mesh", "1x2x1", "--scan", "--remat", "quantized"],
    "nvfp4": ["--recipe", "nvfp4", "--mesh", "1x1x2", "--remat", "full"],
}


def _check(results, names, steps):
    import json

    assert [r["name"] for r in results] == list(names)
    for r in results:
        assert len(r["a"]["curve"]) == steps, r["a"]["curve"]
        for other in ("b", "c"):  # b: a second run; c: stopped at steps / 2, checkpointed and resumed
            assert r[other]["curve"] == r["a"]["curve"], (r["name"], other, json.dumps(r)[:2000])
            assert (r[other]["sha"], r[other]["val"], r[other]["se"]) == (r["a"]["sha"], r["a"]["val"], r["a"]["se"])


@pytest.mark.slow
def test_deterministic_runs_and_resume_cpu(tmp_path):
    import json

    results = run_results(SCRIPT, 2, [tmp_path, json.dumps(BASE), json.dumps(CPU_CONFIGS)], timeout=1200)
    _check(results, CPU_CONFIGS, 4)


GPU_BASE = ["--preset", "large-350m", "--layers", "2", "--d-model", "512", "--mlp-hidden", "1408", "--tokenizer",
            "bytes", "--corpus", "stdlib", "--batch", "8", "--seq", "512", "--steps", "20", "--eval-every", "10",
            "--eval-batches", "2", "--val-tokens", "0", "--log-every", "1", "--no-progress", "--deterministic",
            "--seeds", "0"]


def _gpu_runs(tmp_path, base):
    """Runs a, b and c (10 steps, checkpoint, 10 resumed) of bf16, nvfp4-fwd-mxfp8-bwd and nvfp4 in this process (a
    child process could not create its CUDA context beside the parent's) and checks them."""
    import csv
    import json

    sys.path.insert(0, str(ROOT / "examples" / "lm"))
    import train_lm

    def curve(d):
        with (d / "curves.csv").open(newline="") as f:
            return [[r["step"], r["train_loss"], r["val_loss"]] for r in csv.DictReader(f)]

    results = []
    for name in ("bf16", "nvfp4-fwd-mxfp8-bwd", "nvfp4"):
        res = {"name": name}
        for run, extra in (("a", []), ("b", []), ("c", ["--stop-at", "10"]), ("c", ["--resume"])):
            s = next(iter(train_lm.main([*base, "--recipe", name, "--out", str(tmp_path / name / run),
                                         *extra]).values()))
            res[run] = {"sha": s["model_sha256"], "val": s["val_loss"], "se": s["val_loss_se"],
                        "curve": curve(tmp_path / name / run)}
        results.append(json.loads(json.dumps(res)))
    _check(results, ("bf16", "nvfp4-fwd-mxfp8-bwd", "nvfp4"), 20)


@pytest.mark.gpu
def test_deterministic_runs_and_resume_two_gpus(tmp_path):
    """The Llama block with XLA's attention on the 2-GPU fsdp mesh."""
    import jax

    if jax.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {jax.device_count()}")
    _gpu_runs(tmp_path, [*GPU_BASE, "--mesh", "1x2x1"])


@pytest.mark.gpu
def test_deterministic_runs_with_cudnn_attention_one_gpu(tmp_path):
    """--deterministic --attention cudnn on one GPU: cuDNN's fused attention under XLA's deterministic ops."""
    import jax

    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    _gpu_runs(tmp_path, [*GPU_BASE, "--attention", "cudnn"])


@pytest.mark.gpu
def test_cudnn_attention_unrolled_blocks_and_segments_one_gpu(tmp_path):
    """Two unrolled blocks, and a scanned stack split into two segments (--bf16-last 1), under deterministic ops with
    cuDNN's attention: XLA compiles such steps only when no two attention graphs are identical (each site its own
    window, ModelConfig.distinct_attention); two runs give the same losses and bits."""
    import jax

    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    sys.path.insert(0, str(ROOT / "examples" / "lm"))
    import train_lm

    base = [*GPU_BASE, "--attention", "cudnn", "--steps", "6", "--eval-every", "6"]
    for name, flags in (("unrolled", ["--no-scan", "--recipe", "bf16"]),
                        ("segments", ["--recipe", "nvfp4-fwd-mxfp8-bwd", "--bf16-last", "1"])):
        runs = [next(iter(train_lm.main([*base, *flags, "--out", str(tmp_path / name / r)]).values())) for r in "ab"]
        assert [(s["model_sha256"], s["val_loss"]) for s in runs[1:]] == [(runs[0]["model_sha256"],
                                                                           runs[0]["val_loss"])], name
