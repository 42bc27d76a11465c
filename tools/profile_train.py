"""Kernel-time profile of train_lm.py's training steps: where a step's GPU time goes, per recipe, as a table and JSON.

    python tools/profile_train.py --out $OUT/profile.json -- --preset large --mesh 1x2x1 --remat none \\
        --recipes bf16,nvfp4-fwd-mxfp8-bwd --fsdp-reduce output --steps 16 --eval-every 16 --eval-batches 1
    python tools/profile_train.py --trace DIR_OR_XPLANE_PB --executions 17     # summarise an existing trace

The arguments after "--" go to examples/lm/train_lm.py, which runs under `jax.profiler.trace`. The summary reads the
trace's "/device:GPU:<device>" plane (`jax.profiler.ProfileData`): the kernels on its stream lines. The recipes of
one process run one after the other, separated by a compile, so kernels more than 1 s apart start a new segment, and
the segments holding kernels of the training step (XLA module "jit_train", the "hlo_module" statistic) are kept: one
per recipe, with every kernel in it (collectives and copies included; also the state copy of each evaluation). Per
segment, in ms per step execution (the segment's kernel time / `executions`):

  * kernel time by category, summed over streams: gemm (cuBLAS, CUTLASS, XLA GEMM fusions), attention (cuDNN
    flash), jax_fp4 kernel (this package's kernels), nccl (collectives), memcpy/memset, xla fusion/other;
  * busy: the union of the compute kernels' intervals (every category but nccl); nccl exposed: the NCCL time during
    which no compute kernel runs; span: first kernel to last.

`executions` counts the step program's runs in a segment: the training steps plus one per evaluation batch
(train_lm evaluates with the same compiled step: --eval-batches at every --eval-every and at the end); by default
it is derived from the train_lm arguments. The first execution (autotuning, warm-up) is included. A CPU trace has no
GPU plane: the tool says so and writes an empty segment list.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling, also under python -P
import profile_dense  # noqa: E402 - tools/profile_dense.py: the kernel-name categories

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_MODULE = "jit_train"
SEGMENT_GAP_NS = 1_000_000_000
CATEGORIES = ("gemm", "attention", "jax_fp4 kernel", "nccl", "memcpy/memset", "xla fusion/other")


def category(kernel: str) -> str:
    """The category of a kernel by its name: NCCL collectives and cuDNN attention first, then tools/profile_dense.py's
    categories (GEMM, jax_fp4 kernel, memcpy/memset, XLA fusion/other)."""
    k = kernel.lower()
    if "nccl" in k:
        return "nccl"
    if any(s in k for s in ("cudnn", "fmha", "flash", "sdpa")):
        return "attention"
    return profile_dense.category(kernel)


def union(intervals) -> list[list[int]]:
    """The sorted, disjoint union of [start, end) intervals."""
    out: list[list[int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def overlap(a, b) -> int:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def segments(kernels, gap_ns: int = SEGMENT_GAP_NS) -> list[list[tuple]]:
    """Kernels (start_ns, end_ns, name, ...) split where the GPU idles for more than gap_ns."""
    out: list[list[tuple]] = []
    end = None
    for k in sorted(kernels):
        if end is None or k[0] - end > gap_ns:
            out.append([])
            end = k[1]
        out[-1].append(k)
        end = max(end, k[1])
    return out


def summarize(kernels, executions: int, top: int = 12) -> dict:
    """One segment's kernels (start_ns, end_ns, name, ...) as ms per execution (module docstring)."""
    per_cat = dict.fromkeys(CATEGORIES, 0)
    per_kernel: dict[tuple, int] = {}
    compute, comm = [], []
    for s, e, name, *_ in kernels:
        c = category(name)
        per_cat[c] += e - s
        per_kernel[(c, name)] = per_kernel.get((c, name), 0) + e - s
        (comm if c == "nccl" else compute).append((s, e))
    busy, nccl = union(compute), union(comm)
    ms = 1e-6 / executions
    return {
        "executions": executions,
        "span_ms": (max(k[1] for k in kernels) - kernels[0][0]) * ms,
        "busy_ms": sum(e - s for s, e in busy) * ms,
        "nccl_exposed_ms": (sum(e - s for s, e in nccl) - overlap(busy, nccl)) * ms,
        "kernel_ms": {c: v * ms for c, v in per_cat.items()},
        "top_kernels": [{"category": c, "kernel": k[:120], "ms": v * ms}
                        for (c, k), v in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]],
    }


def step_kernels(xplane_path: str, device: int = 0):
    """(start_ns, end_ns, name, XLA module) of every kernel on one GPU's streams; None when the trace has no such
    plane."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xplane_path)
    for plane in data.planes:
        if plane.name != f"/device:GPU:{device}":
            continue
        out = []
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                stats = {str(k): v for k, v in ev.stats}
                out.append((ev.start_ns, ev.start_ns + ev.duration_ns, ev.name, str(stats.get("hlo_module", ""))))
        return out
    return None


def executions_of(train_args: list[str]) -> int:
    """The step program's runs per recipe that train_lm's arguments ask for: steps + eval batches x the evaluations
    before the last + the last evaluation's batches (`RunConfig.final_eval_batches`)."""
    sys.path.insert(0, os.path.join(ROOT, "examples", "lm"))
    from lm_config import parse_args

    _, cfg, _ = parse_args(train_args)
    evals = sum(1 for k in range(1, cfg.steps) if k % cfg.eval_every == 0)
    return cfg.steps + cfg.eval_batches * evals + cfg.final_eval_batches


def format_table(result: dict) -> str:
    lines = []
    for i, seg in enumerate(result["segments"]):
        k = seg["kernel_ms"]
        lines.append(f"segment {i} ({seg['executions']} executions), ms per execution: span {seg['span_ms']:.1f}, "
                     f"compute busy {seg['busy_ms']:.1f}, nccl exposed {seg['nccl_exposed_ms']:.1f}")
        lines.append("  " + ", ".join(f"{c} {k[c]:.1f}" for c in CATEGORIES))
        lines += [f"    {t['ms']:8.2f} {t['category']:16s} {t['kernel'][:90]}" for t in seg["top_kernels"]]
    return "\n".join(lines) if lines else "no GPU kernels of the training step in this trace (a CPU run?)"


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    own, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", help="summarise this trace (a directory holding *.xplane.pb, or the file)")
    p.add_argument("--executions", type=int, help="step executions per segment (default: from the train_lm args)")
    p.add_argument("--device", type=int, default=0, help="the GPU plane to read (default 0)")
    p.add_argument("--out", help="write the summary as JSON here")
    args = p.parse_args(own)
    if args.trace is None and not train_args:
        p.error("give train_lm arguments after '--', or --trace")
    if args.executions is None and not train_args:
        p.error("--trace needs --executions (the step's runs per recipe)")
    executions = args.executions or executions_of(train_args)
    trace = args.trace
    if trace is None:
        import jax

        sys.path.insert(0, os.path.join(ROOT, "examples", "lm"))
        import train_lm

        trace = tempfile.mkdtemp(prefix="profile_train_")
        with jax.profiler.trace(trace):
            train_lm.main(train_args)
    path = trace if trace.endswith(".pb") else sorted(glob.glob(f"{trace}/**/*.xplane.pb", recursive=True))[-1]
    kernels = step_kernels(path, args.device)
    result = {"trace": path, "train_args": train_args, "gpu_plane": kernels is not None,
              "segments": [summarize(seg, executions) for seg in segments(kernels or [])
                           if any(k[3] == STEP_MODULE for k in seg)]}
    print(format_table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
