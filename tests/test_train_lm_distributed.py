"""train_lm.py over several processes on JAX's distributed runtime (examples/lm/lm_distributed.py), on the CPU.

* two processes of one forced CPU device each (gloo collectives, a plain launch with --coordinator) train the tiny
  preset on a 1x2x1 fsdp mesh with --deterministic and nvfp4-fwd-mxfp8-bwd (each device quantizes its weight slice,
  the codes and block scales are gathered across the processes): the same train and validation losses and
  `summary["model_sha256"]` as one process of two devices on the same mesh, bit for bit; the two-process run's
  step-2 checkpoint resumed by one process ends with the same bits too;
* importing jax_fp4 and train_lm starts no JAX backend (jax.distributed.initialize may follow the imports);
* bad setups stop with a message naming the fix: a coordinator that does not answer within --init-timeout, processes
  holding different numbers of devices for the mesh, a --out that is not one directory for all, tokenizer cache
  keys that differ between the processes, a batch whose rows do not split over the processes (`process_rows`), and
  incomplete launch flags.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "lm"))

import lm_distributed  # noqa: E402

BASE = ["--preset", "tiny", "--layers", "1", "--batch", "8", "--seq", "32", "--steps", "4", "--eval-every", "2",
        "--eval-batches", "1", "--log-every", "1", "--no-progress", "--deterministic"]
QUANT = ["--recipe", "nvfp4-fwd-mxfp8-bwd", "--mesh", "1x2x1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def _cmd(argv) -> list[str]:
    return [sys.executable, "-P", str(ROOT / "examples" / "lm" / "train_lm.py"), *map(str, argv)]


def _one(argv, devices=2, timeout=600):
    proc = subprocess.run(_cmd(argv), env=_env(devices), cwd=ROOT, text=True, capture_output=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return proc


def _launch(argvs, devices, timeout=600, init_timeout=60):
    """Runs one train_lm.py process per argv (a plain launch: --coordinator 127.0.0.1:<free port>), process i with
    devices[i] forced CPU devices; returns [(returncode, stdout, stderr)] in process order."""
    coord = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen(_cmd([*argv, "--coordinator", coord, "--num-processes", len(argvs), "--process-id", i,
                                    "--init-timeout", init_timeout]),
                              env=_env(devices[i]), cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for i, argv in enumerate(argvs)]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def _result(out: Path, run: str):
    with (out / "curves.csv").open(newline="") as f:
        curve = [(r["step"], r["train_loss"], r["val_loss"]) for r in csv.DictReader(f) if r["recipe"] == run]
    s = json.loads((out / "summary.json").read_text())[run]
    return curve, s["model_sha256"], s["val_loss"], s["val_seq_losses"]


@pytest.mark.slow
def test_two_processes_match_one_and_resume_in_one(tmp_path):
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    _one([*BASE, *QUANT, "--out", one])
    res = _launch([[*BASE, *QUANT, "--out", two, "--ckpt-every", "2"]] * 2, devices=[1, 1])
    assert [r[0] for r in res] == [0, 0], [(r[0], r[2][-3000:]) for r in res]
    for line in ("data: ", "val loss", "curves: "):  # process 0 prints the run's log and table, process 1 none of it
        assert line in res[0][1] and line not in res[1][1], (line, res[1][1][-2000:])
    assert json.loads((two / "summary.json").read_text())["nvfp4-fwd-mxfp8-bwd"]["processes"] == 2
    ref = _result(one, "nvfp4-fwd-mxfp8-bwd")
    assert len(ref[0]) == 4 and all(r[1] for r in ref[0])
    assert _result(two, "nvfp4-fwd-mxfp8-bwd") == ref
    # the two processes' checkpoint at step 2 (each wrote its shards), resumed by one process of two devices
    shutil.copytree(two / "checkpoints", resumed / "checkpoints")
    shutil.rmtree(resumed / "checkpoints" / "nvfp4-fwd-mxfp8-bwd" / "4")
    proc = _one([*BASE, *QUANT, "--out", resumed, "--resume"])
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout, proc.stdout[-2000:]
    assert _result(resumed, "nvfp4-fwd-mxfp8-bwd") == ref


@pytest.mark.slow
def test_bad_setups_fail_fast(tmp_path):
    # process 1 of 2 and no process 0: the coordinator never answers
    port = _free_port()
    proc = subprocess.run(_cmd([*BASE, "--recipe", "bf16", "--out", tmp_path / "x", "--coordinator",
                                f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1", "--init-timeout",
                                "2"]), env=_env(1), cwd=ROOT, text=True, capture_output=True, timeout=120)
    assert proc.returncode != 0
    assert f"the coordinator 127.0.0.1:{port} did not answer within --init-timeout 2 s" in proc.stderr, proc.stderr
    assert "start process 0" in proc.stderr
    # 3 devices over 2 processes holding 2 and 1 of them
    res = _launch([[*BASE, "--recipe", "bf16", "--batch", "6", "--seq", "64", "--mesh", "3x1", "--out",
                    tmp_path / "y"]] * 2, devices=[2, 1])
    for rc, _, err in res:
        assert rc == 2, err[-3000:]
        assert "over 2 processes holding 2, 1 devices: the process count must divide the mesh" in err, err[-3000:]
    # a different --out per process: not one directory
    res = _launch([[*BASE, "--recipe", "bf16", "--mesh", "2x1", "--out", tmp_path / f"out{i}"] for i in range(2)],
                  devices=[1, 1])
    for rc, _, err in res:
        assert rc != 0 and f"--out {tmp_path / 'out0'} is not one directory for all processes: process(es) 1 do " \
            "not see the marker" in err or f"--out {tmp_path / 'out1'} is not one directory" in err, err[-3000:]
        assert "give every process the same --out on a filesystem they share" in err
    # different corpora, hence different tokenizer cache keys
    data = []
    for i in range(2):
        data.append(tmp_path / f"data{i}.txt")
        data[i].write_text("".join(f"def f{k}(x):\n    return x * {k + i}\n" for k in range(400)))
    res = _launch([[*BASE, "--recipe", "bf16", "--mesh", "2x1", "--tokenizer", "bpe", "--vocab", "300", "--data",
                    data[i], "--out", tmp_path / "z"] for i in range(2)], devices=[1, 1])
    for rc, _, err in res:
        assert rc != 0 and "the tokenizer cache keys differ between the processes (process 0: bpe-300-" in err, err
        assert "give every process the same --data file" in err
    assert not (tmp_path / "z" / "tokenizer").exists()  # stopped before training a tokenizer


def test_import_starts_no_backend():
    """jax.distributed.initialize must precede the backend's start: importing jax_fp4 and train_lm creates no device
    array (a one-process 'cluster' here)."""
    script = ("import sys; sys.path.insert(0, 'examples/lm'); import jax, jax_fp4, train_lm; "
              f"jax.distributed.initialize('127.0.0.1:{_free_port()}', 1, 0, initialization_timeout=30); "
              "print('RESULT', jax.process_count())")
    proc = subprocess.run([sys.executable, "-P", "-c", script], env=_env(1), cwd=ROOT, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0 and "RESULT 1" in proc.stdout, proc.stderr[-3000:]


class _Dev:
    def __init__(self, process_index):
        self.process_index = process_index


class _Sharding:
    def __init__(self, rows_by_device):
        self.map = rows_by_device

    def devices_indices_map(self, shape):
        return {d: (slice(lo, hi), slice(None)) for d, (lo, hi) in self.map.items()}


def test_process_rows():
    a, b, c, d = _Dev(0), _Dev(1), _Dev(0), _Dev(1)
    # data 2 x tensor 2, each process a row of the mesh: contiguous halves (tensor replicas hold the same rows)
    sh = _Sharding({a: (0, 4), c: (0, 4), b: (4, 8), d: (4, 8)})
    assert lm_distributed.process_rows(sh, 8, 32, process=0) == (0, 4)
    assert lm_distributed.process_rows(sh, 8, 32, process=1) == (4, 8)
    # four batch shards dealt to the processes alternately: process 0 holds rows 0-1 and 4-5
    sh = _Sharding({a: (0, 2), b: (2, 4), c: (4, 6), d: (6, 8)})
    with pytest.raises(ValueError, match=r"does not split over the processes: process 0's devices hold rows "
                                         r"\[0, 1, 4, 5\], not one contiguous range; order the mesh"):
        lm_distributed.process_rows(sh, 8, 32, process=0)


def test_setup_problems():
    def ns(**kw):
        return SimpleNamespace(**{"distributed": False, "coordinator": None, "num_processes": None,
                                  "process_id": None, "init_timeout": 300, **kw})

    assert lm_distributed.setup_problems(ns()) == []
    assert lm_distributed.setup_problems(ns(distributed=True)) == []
    assert lm_distributed.setup_problems(ns(coordinator="h:1", num_processes=2, process_id=1)) == []
    assert "needs all of --coordinator" in lm_distributed.setup_problems(ns(coordinator="h:1"))[0]
    assert "not both" in lm_distributed.setup_problems(ns(distributed=True, coordinator="h:1", num_processes=2,
                                                          process_id=0))[0]
    assert "is not HOST:PORT" in lm_distributed.setup_problems(ns(coordinator="h", num_processes=2, process_id=0))[0]
    assert "--process-id 2 is not in 0 .. --num-processes - 1 = 1" in lm_distributed.setup_problems(
        ns(coordinator="h:1", num_processes=2, process_id=2))[0]
