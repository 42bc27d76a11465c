"""Precision-control study: train_lm.py over remedy configurations x seeds, spread over the local GPUs, with each
configuration's validation-loss gap to bf16 reported as the mean over seeds with its spread.

Every (configuration, seed) run is one `train_lm.py` process with its own output directory; `--per-gpu` runs share
a GPU at a time (small models do not fill an H100, so two or three share one well; their tokens/s are then not
comparable, only the losses are). bf16 runs once per seed and is the reference of every gap of that seed. At the
end the runs' summaries are merged (keyed "<configuration>@s<seed>"), the gaps computed (`lm_stats.seed_gaps`: each
seed paired with bf16 of the same seed; the mean over seeds with its 95 % Student-t interval, the evaluation noise
and the same-seed spread of `--repeats`) and written to OUT/gaps.csv, OUT/gaps.json, OUT/gaps.png and
OUT/summary.json, with a table on stdout. A gap whose interval contains 0 is reported as unresolved.
`--deterministic` runs every run bit-reproducibly (train_lm --deterministic). Every run is one process on one GPU
(many small runs fill the GPUs best); one configuration across processes or hosts is a train_lm.py run of its own
(its --distributed / --coordinator flags are refused here). A run whose OUT/runs/<run>/summary.json exists is not
run again: an interrupted study continues, and one split over several invocations (a seed per call on a machine that
keeps no files: copy each call's OUT/runs together) is merged by invoking it once more over the union.

    python examples/lm/precision_study.py --preset small --seeds 0 1 2 --per-gpu 3 --out runs/study
    python examples/lm/precision_study.py --preset tiny --steps 20 --seeds 0 1 2 --configs nvfp4-fwd-mxfp8-bwd \
        --out runs/study-cpu            # on the CPU: one run at a time

Configurations are named in CONFIGS (recipe plus train_lm precision flags); `--configs a,b` picks some. Extra
arguments after `--` go to every train_lm.py run (e.g. `-- --eval-batches 8`).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lm_stats  # noqa: E402

# name -> (recipe, train_lm flags). The remedies are those of arXiv 2509.25149: high-precision last blocks, and a
# switch of the forward GEMMs to bf16 for the last 10 % of training.
CONFIGS = {
    "nvfp4-fwd-mxfp8-bwd": ("nvfp4-fwd-mxfp8-bwd", []),
    "nvfp4-fwd-mxfp8-bwd+last1": ("nvfp4-fwd-mxfp8-bwd", ["--bf16-last", "1"]),
    "nvfp4-fwd-mxfp8-bwd+switch0.9": ("nvfp4-fwd-mxfp8-bwd", ["--switch-at", "0.9", "--switch-to", "bf16",
                                                              "--switch-scope", "fwd"]),
    "nvfp4-fwd-mxfp8-bwd+last1+switch0.9": ("nvfp4-fwd-mxfp8-bwd", ["--bf16-last", "1", "--switch-at", "0.9",
                                                                    "--switch-to", "bf16", "--switch-scope", "fwd"]),
    "nvfp4": ("nvfp4", []),
    "nvfp4+last1": ("nvfp4", ["--bf16-last", "1"]),
    "nvfp4+switch0.9": ("nvfp4", ["--switch-at", "0.9", "--switch-to", "bf16", "--switch-scope", "fwd"]),
    "nvfp4+last1+switch0.9": ("nvfp4", ["--bf16-last", "1", "--switch-at", "0.9", "--switch-to", "bf16",
                                        "--switch-scope", "fwd"]),
    "mxfp8": ("mxfp8", []),
    # 4over6 forward operands (NVFP4(use_4over6=True), docs/numerics.md section 1)
    "nvfp4-fwd-mxfp8-bwd-4over6": ("nvfp4-fwd-mxfp8-bwd-4over6", []),
    "nvfp4-fwd-mxfp8-bwd-4over6+switch0.9": ("nvfp4-fwd-mxfp8-bwd-4over6", ["--switch-at", "0.9", "--switch-to", "bf16",
                                                                            "--switch-scope", "fwd"]),
    "nvfp4-4over6": ("nvfp4-4over6", []),
}


def _gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def _jobs(configs: list[str], seeds: list[int], repeats: int = 0) -> list[tuple[str, str, list[str], int]]:
    """(tag, recipe, flags, seed) per run; bf16 first for every seed, then its `repeats` same-seed repeats of the
    first seed ("bf16+repeat<k>", the same-seed spread), then the configurations seed by seed."""
    jobs = [("bf16", "bf16", [], s) for s in seeds]
    jobs += [(f"bf16+repeat{k}", "bf16", [], seeds[0]) for k in range(1, repeats + 1)]
    jobs += [(c, *CONFIGS[c], s) for s in seeds for c in configs]
    return jobs


def _pending(jobs, out: Path):
    """(jobs still to run, names of finished runs): a run whose directory under out/runs holds its summary.json is
    done, so a study interrupted (or split over several invocations, e.g. one call per seed on machines that keep no
    files) continues where it stopped, and the gaps cover every finished run under out/runs."""
    todo, finished = [], []
    for job in jobs:
        name = f"{job[0]}@s{job[3]}"
        if (out / "runs" / name / "summary.json").is_file():
            finished.append(name)
        else:
            todo.append(job)
    return todo, finished


# A process that starts while another creates its CUDA context on the same GPU was seen to fail JAX's CUDA backend
# initialisation ("no supported devices found") on a 4-GPU H200 host; such a start is retried.
_START_FAILURE = "Unable to initialize backend 'cuda'"
_START_ATTEMPTS = 4


def _worker(q: queue.Queue, gpu: int | None, mem_fraction: float, args, extra: list[str], done: list):
    script = Path(__file__).resolve().parent / "train_lm.py"
    while True:
        try:
            tag, recipe, flags, seed = q.get_nowait()
        except queue.Empty:
            return
        out = args.out / "runs" / f"{tag}@s{seed}"
        cmd = [sys.executable, str(script), "--recipe", recipe, "--preset", args.preset, "--seeds", str(seed),
               "--out", str(out), "--no-progress", *flags, *extra]
        if args.steps:
            cmd += ["--steps", str(args.steps)]
        if args.deterministic:
            cmd.append("--deterministic")
        env = dict(os.environ)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{mem_fraction:.2f}"
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        for attempt in range(_START_ATTEMPTS):
            with (out / "train.log").open("w") as log:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
            if rc == 0 or _START_FAILURE not in (out / "train.log").read_text(errors="replace"):
                break
            time.sleep(5 + 5 * attempt)  # another run was creating its CUDA context on this GPU: start again
        done.append((tag, seed, rc, time.time() - t0))
        print(f"{tag}@s{seed}: rc {rc}, {time.time() - t0:.0f} s" + (f" (GPU {gpu})" if gpu is not None else ""),
              flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from: {', '.join(CONFIGS)}")
    p.add_argument("--per-gpu", type=int, default=1, help="concurrent runs per GPU")
    p.add_argument("--mem-fraction", type=float, default=None, metavar="F",
                   help="each run's share of its GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION; default 0.9 / "
                        "--per-gpu); lower it when other programs share the GPUs")
    p.add_argument("--gpus", type=lambda s: [int(g) for g in s.split(",")], default=None,
                   help="comma-separated GPU ids to use (default: every GPU nvidia-smi lists)")
    p.add_argument("--repeats", type=int, default=0, metavar="K",
                   help="run bf16 of the first seed K more times (bf16+repeat<k>): the same-seed spread")
    p.add_argument("--deterministic", action="store_true",
                   help="every run with train_lm --deterministic (bit-reproducible; the same-seed spread is 0)")
    p.add_argument("--out", type=Path, default=Path("runs/study"))
    args, extra = p.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    joins = [a for a in extra
             if a.split("=")[0] in ("--distributed", "--coordinator", "--num-processes", "--process-id")]
    if joins:
        p.error(f"{', '.join(joins)}: every run of a study is one process on one GPU (--per-gpu shares them); train "
                "one configuration across processes with train_lm.py itself (README, 'Train at scale', 'Across "
                "hosts')")
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
    q: queue.Queue = queue.Queue()
    jobs, finished = _pending(_jobs(configs, args.seeds, args.repeats), args.out)
    if finished:
        print(f"{len(finished)} run(s) already finished under {args.out / 'runs'} (kept): {', '.join(finished)}")
    for job in jobs:
        q.put(job)
    gpus = args.gpus if args.gpus is not None else list(range(_gpu_count()))
    share = args.mem_fraction if args.mem_fraction is not None else 0.9 / args.per_gpu
    slots = [(g, share) for g in gpus for _ in range(args.per_gpu)] or [(None, 0.0)]
    done: list = []
    t0 = time.time()
    threads = [threading.Thread(target=_worker, args=(q, g, f, args, extra, done)) for g, f in slots]
    for t in threads:
        t.start()
        time.sleep(2)  # stagger the start-ups (corpus loading, compiles)
    for t in threads:
        t.join()
    merged = {}  # {"<configuration>@s<seed>": summary}: each run's directory names it
    for summary in sorted((args.out / "runs").glob("*/summary.json")):
        runs = json.loads(summary.read_text())
        if len(runs) == 1:
            merged[summary.parent.name] = next(iter(runs.values()))
    (args.out / "summary.json").write_text(json.dumps(merged, indent=1))
    gaps = lm_stats.seed_gaps(merged)
    lm_stats.write_gaps(args.out, gaps)
    lm_stats.plot_gaps(args.out, gaps, f"--preset {args.preset}, seeds {' '.join(map(str, args.seeds))}"
                       + (", deterministic" if args.deterministic else ""))
    failed = [(t, s, rc) for t, s, rc, _ in done if rc != 0]
    print(f"\n{len(done)} runs in {time.time() - t0:.0f} s over {len(slots)} slot(s)"
          + (f"; FAILED: {failed} (see {args.out}/runs/<run>/train.log)" if failed else ""))
    print(f"gap to bf16 over seeds ({args.out / 'gaps.csv'}):")
    print(lm_stats.format_gaps(gaps))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
