"""examples/lm/train_lm.py as N processes of one GPU each against one process of N GPUs: the same losses and
`model_sha256` (--deterministic), the tokens/s ratio, and the N-process run's middle checkpoint resumed by one process.

For each recipe: (one) one process over every GPU; (multi) N processes (a plain launch: --coordinator, each process
CUDA_VISIBLE_DEVICES=i); (resumed) the multi run's checkpoint at steps / 2 resumed by one process. The runs take the
same preset, mesh, seed and flags, `--deterministic`, and `--ckpt-every steps / 2`. Prints a line per recipe and
writes OUT/compare_processes.json (after every recipe): per recipe the three runs' val_loss, model_sha256, tokens/s,
whether the curves (step, train loss, validation loss) and checksums agree bit for bit, and multi / one tokens/s.
Exits 1 when any pair differs or a run fails (each run's log: OUT/<recipe>/<run>.log).

    python tools/compare_processes.py --gpus 2 --out $OUT/cmp -- --preset large-350m --layers 8 --mesh 1x2x1 \\
        --steps 40 --eval-every 20 --val-tokens 0 --corpus stdlib --tokenizer bytes
    JAX_PLATFORMS=cpu python tools/compare_processes.py --gpus 0 --cpu-devices 2 --out runs/cmp -- --preset tiny \\
        --layers 1 --batch 8 --seq 32 --steps 4 --eval-every 2 --eval-batches 1 --mesh 1x2x1   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "lm" / "train_lm.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(device: int | None, n: int, cpu_devices: int) -> dict:
    """One GPU (device) or every GPU (None); on the CPU (--gpus 0), cpu_devices per process split n ways."""
    env = dict(os.environ)
    if cpu_devices:
        per = cpu_devices if device is None else cpu_devices // n
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={per}".strip()
    elif device is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(device)
    return env


def _run(cmds, envs, logs) -> list[int]:
    procs = []
    for cmd, env, log in zip(cmds, envs, logs, strict=True):
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as f:
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))
    return [p.wait() for p in procs]


def _read(out: Path, recipe: str) -> dict:
    with (out / "curves.csv").open(newline="") as f:
        curve = [[r["step"], r["train_loss"], r["val_loss"]] for r in csv.DictReader(f) if r["recipe"] == recipe]
    s = json.loads((out / "summary.json").read_text())[recipe]
    return {"curve": curve, "sha": s["model_sha256"], "val_loss": s["val_loss"], "tokens_per_s": s["tokens_per_s"],
            "processes": s.get("processes")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=2, help="N: processes of one GPU each (0: the CPU, --cpu-devices)")
    p.add_argument("--cpu-devices", type=int, default=0, help="with --gpus 0: forced CPU devices of the one process")
    p.add_argument("--recipes", default="bf16,nvfp4-fwd-mxfp8-bwd")
    p.add_argument("--out", type=Path, required=True)
    args, extra = p.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    n = args.gpus or 2
    steps = int(extra[extra.index("--steps") + 1]) if "--steps" in extra else None
    if steps is None or steps < 2:
        p.error("give train_lm flags after --, with --steps S (S >= 2)")
    base = [sys.executable, str(TRAIN), *extra, "--deterministic", "--no-progress", "--ckpt-every", str(steps // 2)]
    results, ok = {}, True
    for recipe in args.recipes.split(","):
        d = args.out / recipe
        one, multi, resumed = d / "one", d / "multi", d / "resumed"
        t0 = time.time()
        rc = _run([[*base, "--recipe", recipe, "--out", str(one)]], [_env(None, n, args.cpu_devices)], [d / "one.log"])
        coord = f"127.0.0.1:{_free_port()}"
        rc += _run([[*base, "--recipe", recipe, "--out", str(multi), "--coordinator", coord, "--num-processes",
                     str(n), "--process-id", str(i)] for i in range(n)],
                   [_env(i, n, args.cpu_devices) for i in range(n)], [d / f"multi{i}.log" for i in range(n)])
        if not any(rc):
            shutil.rmtree(resumed, ignore_errors=True)
            shutil.copytree(multi / "checkpoints", resumed / "checkpoints")
            shutil.rmtree(resumed / "checkpoints" / recipe / str(steps))  # keep the one at steps // 2
            rc += _run([[*base, "--recipe", recipe, "--out", str(resumed), "--resume"]],
                       [_env(None, n, args.cpu_devices)], [d / "resumed.log"])
        if any(rc):
            results[recipe] = {"returncodes": rc}
            ok = False
            print(f"{recipe}: a run failed (return codes {rc}); logs under {d}")
            (args.out / "compare_processes.json").write_text(json.dumps(results, indent=1))
            continue
        r = {k: _read(v, recipe) for k, v in (("one", one), ("multi", multi), ("resumed", resumed))}
        same = {k: r[k]["curve"] == r["one"]["curve"] and r[k]["sha"] == r["one"]["sha"] for k in ("multi", "resumed")}
        ratio = r["multi"]["tokens_per_s"] / r["one"]["tokens_per_s"]
        results[recipe] = {**r, "same_bits": same, "tokens_per_s_multi_over_one": ratio, "wall_s": time.time() - t0}
        ok &= all(same.values())
        print(f"{recipe}: val_loss one {r['one']['val_loss']:.6f} / {n} processes {r['multi']['val_loss']:.6f} / "
              f"resumed {r['resumed']['val_loss']:.6f}; same bits: {same}; tokens/s one "
              f"{r['one']['tokens_per_s']:,.0f}, {n} processes {r['multi']['tokens_per_s']:,.0f} "
              f"(x{ratio:.3f}); {time.time() - t0:.0f} s", flush=True)
        (args.out / "compare_processes.json").write_text(json.dumps(results, indent=1))  # after every recipe
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
