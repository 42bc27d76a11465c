"""Precision-control study: train_lm.py over remedy configurations x seeds, spread over the local GPUs, with each
configuration's validation-loss gap to bf16 reported as the mean over seeds with its spread.

Every (configuration, seed) run is one `train_lm.py` process with its own output directory; `--per-gpu` runs share
a GPU at a time (small models do not fill an H100, so two or three share one well; their tokens/s are then not
comparable, only the losses are). bf16 runs once per seed and is the reference of every gap of that seed. At the
end the runs' summaries are merged (keyed "<configuration>@s<seed>"), the gaps computed (`lm_stats.seed_gaps`: each
seed paired with bf16 of the same seed; the mean over seeds with its 95 % Student-t interval, the evaluation noise
and the same-seed spread of the `--repeats` runs of `--repeat-configs`, bf16 by default) and written to
OUT/gaps.csv, OUT/gaps.json, OUT/gaps.png and OUT/summary.json, with a table on stdout. A gap whose interval
contains 0 is reported as unresolved.
`--deterministic` runs every run bit-reproducibly (train_lm --deterministic). Every run is one process on one GPU
(many small runs fill the GPUs best), or on `--gpus-per-run N` GPUs (consecutive ones of --gpus, with train_lm
`--mesh 1xNx1`, the fsdp mesh, unless a --mesh follows `--`) for models or deterministic steps too slow for one GPU
within a run's time; one configuration across processes or hosts is a train_lm.py run of its own (its
--distributed / --coordinator flags are refused here). A run whose OUT/runs/<run>/summary.json exists is not
run again: an interrupted study continues, and one split over several invocations (a seed per call on a machine that
keeps no files: copy each call's OUT/runs together) is merged by invoking it once more over the union.
`--start-by S` starts no run later than S seconds after the study began, so that a study cut into calls of a fixed
length ends between runs rather than killing one (the runs left are listed; invoking it again trains them).
`--merge-only` trains nothing: it merges every finished run under OUT/runs (e.g. the runs directories of a study
split over several machines, copied together) into the same OUT/summary.json, gaps files and table.
The runs share one BPE tokenizer: each run's tokenizer cache (OUT/runs/<run>/tokenizer) is a relative link to
OUT/tokenizer, so the tokenizer is trained once per study, not once per run (runs starting together may each train
it; lm_tokenizer writes the cache files atomically), and a copied study keeps its links.

    python examples/lm/precision_study.py --preset small --seeds 0 1 2 --per-gpu 3 --out runs/study
    python examples/lm/precision_study.py --preset tiny --steps 20 --seeds 0 1 2 --configs nvfp4-fwd-mxfp8-bwd \
        --out runs/study-cpu            # on the CPU: one run at a time
    python examples/lm/precision_study.py --preset small --merge-only --out runs/study   # runs/study/runs copied in
    python examples/lm/precision_study.py --preset large --gpus-per-run 2 --seeds 0 1 --out runs/study-1b

Configurations are named in CONFIGS (recipe plus train_lm precision flags); `--configs a,b` picks some. Extra
arguments after `--` go to every train_lm.py run (e.g. `-- --eval-batches 8`).
"""

from __future__ import annotations

import argparse
import csv
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


def _jobs(configs: list[str], seeds: list[int], repeats: int = 0,
          repeat_configs: tuple[str, ...] = ("bf16",)) -> list[tuple[str, str, list[str], int]]:
    """(tag, recipe, flags, seed) per run; bf16 first for every seed, then `repeats` same-seed repeats of the first
    seed of each of `repeat_configs` ("<configuration>+repeat<k>", the same-seed spread), then the configurations
    seed by seed."""
    known = {"bf16": ("bf16", []), **CONFIGS}
    jobs = [("bf16", "bf16", [], s) for s in seeds]
    jobs += [(f"{c}+repeat{k}", *known[c], seeds[0]) for c in repeat_configs for k in range(1, repeats + 1)]
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


def _prepare_run_dir(out: Path, name: str) -> Path:
    """OUT/runs/<name>, created, with its tokenizer cache (train_lm's --out/tokenizer) a link to the study's
    OUT/tokenizer, given as the relative "../../tokenizer" so a copied study stays valid. A finished run's directory
    (one with a summary.json) and a tokenizer directory that is not a link are left as they are; a link pointing
    elsewhere is replaced. Without symbolic links (OSError) the run keeps a cache of its own."""
    run = out / "runs" / name
    run.mkdir(parents=True, exist_ok=True)
    if (run / "summary.json").is_file():
        return run
    link = run / "tokenizer"
    target = Path("..", "..", "tokenizer")
    (out / "tokenizer").mkdir(exist_ok=True)
    try:
        if link.is_symlink():
            if Path(os.readlink(link)) == target:
                return run
            link.unlink()
        elif link.exists():
            return run
        link.symlink_to(target, target_is_directory=True)
    except OSError:
        pass
    return run


def _run_seeds(names) -> list[int]:
    """The seeds named by the run names ("<configuration>@s<seed>"), sorted."""
    return sorted({seed for seed in (lm_stats.split_name(n)[1] for n in names) if seed is not None})


def _merged(out: Path) -> dict:
    """{"<configuration>@s<seed>": summary} of every finished run under OUT/runs (each run's directory names it; a
    summary.json holding other than one run is left out), with "val_curve" from the run's curves.csv (for
    `lm_stats.pre_switch_spread`)."""
    merged = {}
    for summary in sorted((out / "runs").glob("*/summary.json")):
        runs = json.loads(summary.read_text())
        if len(runs) == 1:
            merged[summary.parent.name] = next(iter(runs.values()))
            curve = _val_curve(summary.parent / "curves.csv")
            if curve:
                merged[summary.parent.name]["val_curve"] = curve
    return merged


def _val_curve(path: Path) -> list:
    """[[step, val_loss], ...] of a run's curves.csv (the rows with a validation loss), [] without the file."""
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return [[int(r["step"]), float(r["val_loss"])] for r in csv.DictReader(f) if r.get("val_loss")]


def _report(out: Path, merged: dict, preset: str, deterministic: bool = False,
            target_half: float = lm_stats.TARGET_HALF_PCT) -> dict:
    """Writes the merged runs to OUT/summary.json and their gaps to OUT/gaps.csv, gaps.json and gaps.png (titled
    with the preset, the seeds of the merged runs - a continued study's earlier runs included - and "deterministic"
    when `deterministic` or every run was), and prints the gap table with the seeds each interval would need to reach
    ±`target_half` %; returns the gaps (lm_stats.seed_gaps)."""
    (out / "summary.json").write_text(json.dumps(merged, indent=1))
    gaps = lm_stats.seed_gaps(merged, target_half_pct=target_half)
    lm_stats.write_gaps(out, gaps)
    seeds = _run_seeds(merged)
    deterministic = deterministic or (bool(merged) and all(s.get("deterministic") for s in merged.values()))
    title = f"--preset {preset}, seeds {' '.join(map(str, seeds))}" + (", deterministic" if deterministic else "")
    lm_stats.plot_gaps(out, gaps, title)
    print(f"gap to bf16 over seeds ({out / 'gaps.csv'}):")
    print(lm_stats.format_gaps(gaps))
    return gaps


# A process that starts while another creates its CUDA context on the same GPU was seen to fail JAX's CUDA backend
# initialisation ("no supported devices found") on a 4-GPU H200 host; such a start is retried.
_START_FAILURE = "Unable to initialize backend 'cuda'"
_START_ATTEMPTS = 4


def _slots(gpus: list[int], gpus_per_run: int, per_gpu: int, mem_fraction: float | None):
    """(GPU ids of one run, its memory share) per concurrent run: the GPUs in consecutive groups of gpus_per_run (a
    remainder unused), each group per_gpu times; [(None, 0.0)] without GPUs (one run at a time on the CPU)."""
    share = mem_fraction if mem_fraction is not None else 0.9 / per_gpu
    groups = [tuple(gpus[i:i + gpus_per_run]) for i in range(0, len(gpus) - gpus_per_run + 1, gpus_per_run)]
    return [(g, share) for g in groups for _ in range(per_gpu)] or [(None, 0.0)]


def _command(script: Path, args, extra: list[str], recipe: str, flags: list[str], seed: int, out: Path,
             gpus: tuple[int, ...] | None) -> list[str]:
    """The train_lm.py command line of one run; a run over several GPUs gets --mesh 1xNx1 unless extra has a mesh."""
    cmd = [sys.executable, str(script), "--recipe", recipe, "--preset", args.preset, "--seeds", str(seed),
           "--out", str(out), "--no-progress", *flags, *extra]
    if args.steps:
        cmd += ["--steps", str(args.steps)]
    if args.deterministic:
        cmd.append("--deterministic")
    if gpus is not None and len(gpus) > 1 and not any(a.split("=")[0] == "--mesh" for a in extra):
        cmd += ["--mesh", f"1x{len(gpus)}x1"]
    return cmd


def _worker(q: queue.Queue, gpus: tuple[int, ...] | None, mem_fraction: float, args, extra: list[str], done: list,
            start_by: float | None = None):
    """Trains the queued runs one after another on `gpus` until the queue is empty or the clock passes `start_by`
    (time.time(); None: no limit)."""
    script = Path(__file__).resolve().parent / "train_lm.py"
    while True:
        if start_by is not None and time.time() > start_by:
            return
        try:
            tag, recipe, flags, seed = q.get_nowait()
        except queue.Empty:
            return
        out = _prepare_run_dir(args.out, f"{tag}@s{seed}")
        cmd = _command(script, args, extra, recipe, flags, seed, out, gpus)
        env = dict(os.environ)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{mem_fraction:.2f}"
        t0 = time.time()
        for attempt in range(_START_ATTEMPTS):
            with (out / "train.log").open("w") as log:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
            if rc == 0 or _START_FAILURE not in (out / "train.log").read_text(errors="replace"):
                break
            time.sleep(5 + 5 * attempt)  # another run was creating its CUDA context on this GPU: start again
        done.append((tag, seed, rc, time.time() - t0))
        where = f" (GPU {','.join(map(str, gpus))})" if gpus is not None else ""
        print(f"{tag}@s{seed}: rc {rc}, {time.time() - t0:.0f} s{where}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from: {', '.join(CONFIGS)}")
    p.add_argument("--per-gpu", type=int, default=1, help="concurrent runs per GPU (per GPU group)")
    p.add_argument("--gpus-per-run", type=int, default=1, metavar="N",
                   help="GPUs per run (consecutive ones of --gpus; train_lm --mesh 1xNx1 unless a --mesh follows --)")
    p.add_argument("--mem-fraction", type=float, default=None, metavar="F",
                   help="each run's share of its GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION; default 0.9 / "
                        "--per-gpu); lower it when other programs share the GPUs")
    p.add_argument("--gpus", type=lambda s: [int(g) for g in s.split(",")], default=None,
                   help="comma-separated GPU ids to use (default: every GPU nvidia-smi lists)")
    p.add_argument("--repeats", type=int, default=0, metavar="K",
                   help="run the first seed of each --repeat-configs K more times (<configuration>+repeat<k>): "
                        "the same-seed spread")
    p.add_argument("--repeat-configs", default="bf16", metavar="A,B",
                   help="the configurations --repeats repeats (default bf16; a quantized one measures the noise of "
                        "its own runs, which can exceed bf16's); each gap is reported beside its configuration's "
                        "spread where repeated, else bf16's")
    p.add_argument("--deterministic", action="store_true",
                   help="every run with train_lm --deterministic (bit-reproducible; the same-seed spread is 0)")
    p.add_argument("--merge-only", action="store_true",
                   help="train nothing: merge the finished runs under OUT/runs (e.g. copied from several machines) "
                        "into OUT/summary.json and the gaps files")
    p.add_argument("--target-half", type=float, default=lm_stats.TARGET_HALF_PCT, metavar="PCT",
                   help="the interval half-width (%%) the table plans for: its n@±PCT%% column and gaps.csv's "
                        "seeds_needed give the seeds each gap's interval would need at its measured seed sd")
    p.add_argument("--start-by", type=float, default=None, metavar="S",
                   help="start no run later than S seconds after the study began (the runs left are listed; the "
                        "same command trains them later): for machines lent for a fixed time")
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
    if args.start_by is not None and not args.start_by >= 0:
        p.error(f"--start-by {args.start_by}: must be >= 0 seconds")
    if not args.target_half > 0:
        p.error(f"--target-half {args.target_half}: the interval half-width must be > 0 (%)")
    if args.merge_only:
        merged = _merged(args.out)
        if not merged:
            p.error(f"--merge-only: no finished run under {args.out / 'runs'} (no runs/<run>/summary.json of one run)")
        print(f"merged {len(merged)} run(s) from {args.out / 'runs'}: {', '.join(merged)}")
        _report(args.out, merged, args.preset, deterministic=args.deterministic, target_half=args.target_half)
        return 0
    q: queue.Queue = queue.Queue()
    repeat_configs = tuple(c for c in args.repeat_configs.split(",") if c)
    unknown = [c for c in repeat_configs if c != "bf16" and c not in CONFIGS]
    if unknown:
        p.error(f"--repeat-configs: unknown configuration(s) {unknown}; known: bf16, {', '.join(CONFIGS)}")
    jobs, finished = _pending(_jobs(configs, args.seeds, args.repeats, repeat_configs), args.out)
    if finished:
        print(f"{len(finished)} run(s) already finished under {args.out / 'runs'} (kept): {', '.join(finished)}")
    for job in jobs:
        q.put(job)
    gpus = args.gpus if args.gpus is not None else list(range(_gpu_count()))
    if args.gpus_per_run < 1 or args.per_gpu < 1:
        p.error(f"--gpus-per-run {args.gpus_per_run} and --per-gpu {args.per_gpu} must be at least 1")
    if gpus and len(gpus) < args.gpus_per_run:
        p.error(f"--gpus-per-run {args.gpus_per_run}: only {len(gpus)} GPU(s) ({gpus})")
    slots = _slots(gpus, args.gpus_per_run, args.per_gpu, args.mem_fraction)
    done: list = []
    t0 = time.time()
    start_by = None if args.start_by is None else t0 + args.start_by
    threads = [threading.Thread(target=_worker, args=(q, g, f, args, extra, done, start_by)) for g, f in slots]
    for t in threads:
        t.start()
        time.sleep(2)  # stagger the start-ups (corpus loading, compiles)
    for t in threads:
        t.join()
    failed = [(t, s, rc) for t, s, rc, _ in done if rc != 0]
    left = []
    while not q.empty():
        tag, _, _, seed = q.get_nowait()
        left.append(f"{tag}@s{seed}")
    if left:
        print(f"not started (--start-by {args.start_by:g} s): {', '.join(left)}; the same command trains them")
    print(f"\n{len(done)} runs in {time.time() - t0:.0f} s over {len(slots)} slot(s)"
          + (f"; FAILED: {failed} (see {args.out}/runs/<run>/train.log)" if failed else ""))
    _report(args.out, _merged(args.out), args.preset, args.deterministic, args.target_half)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
