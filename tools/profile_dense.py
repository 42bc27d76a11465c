"""Per-kernel GPU time of one Dense training step (benchmarks/dense.py's fwd+bwd step), per recipe.

Runs the compiled step under `jax.profiler.trace` and reads the trace back with `jax.profiler.ProfileData`: every
GPU kernel event of the profiled steps, summed by kernel name and by HLO op, plus a breakdown into categories
(GEMM, jax_fp4 custom calls, other XLA fusions). Nothing outside jax is needed.

Usage on a CUDA machine (package installed on PYTHONPATH, run from outside the checkout):
  python3 -P tools/profile_dense.py --recipes bf16,nvfp4-fwd-mxfp8-bwd [--shape 16384,4096,4096] [--steps 5]
    [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import tempfile

CATEGORIES = (  # (category, substrings of the kernel name, lower case); first match wins
    ("gemm", ("gemm", "xmma", "nvjet", "cutlass", "cublas", "wgmma", "sm90_", "sm80_")),
    ("jax_fp4 kernel", ("jax_fp4", "quantizekernel", "amaxkernel", "dequantize", "swizzle", "rht")),
    ("memcpy/memset", ("memcpy", "memset")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "xla fusion/other"


def gpu_events(xplane_path: str):
    """(kernel name, hlo_op or '', duration_ns) of every event on a GPU device plane."""
    from jax.profiler import ProfileData

    pd = ProfileData.from_file(xplane_path)
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = [ln for ln in plane.lines if "stream" in ln.name.lower()] or list(plane.lines)
        for line in lines:
            for ev in line.events:
                stats = dict(ev.stats)
                yield ev.name, str(stats.get("hlo_op", "")), float(ev.duration_ns)


def profile(recipe: str, m: int, k: int, n: int, steps: int) -> dict:
    import jax

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import dense as bench  # benchmarks/dense.py

    step = bench.make_step(bench.all_layers()[recipe])
    (x, w, b, g, key), = bench.make_argsets(m, k, n, 1)
    jax.block_until_ready(step(x, w, b, g, key))  # compile + warm-up
    jax.block_until_ready(step(x, w, b, g, key))
    d = tempfile.mkdtemp(prefix="jf4prof")
    with jax.profiler.trace(d):
        for _ in range(steps):
            jax.block_until_ready(step(x, w, b, g, key))
    paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise SystemExit(f"no trace written under {d}")
    by_kernel, by_cat, launches = collections.Counter(), collections.Counter(), collections.Counter()
    hlo_of = {}
    for name, hlo, ns in gpu_events(paths[0]):
        by_kernel[name] += ns / steps
        launches[name] += 1
        by_cat[category(name)] += ns / steps
        hlo_of.setdefault(name, hlo)
    return {"recipe": recipe, "shape": [m, k, n], "steps": steps,
            "total_us": sum(by_kernel.values()) / 1e3,
            "categories_us": {c: v / 1e3 for c, v in by_cat.most_common()},
            "kernels": [{"name": nm, "hlo_op": hlo_of[nm], "us": v / 1e3, "launches": launches[nm] / steps}
                        for nm, v in by_kernel.most_common()]}


def report(res: dict, top: int) -> None:
    print(f"\n== {res['recipe']}  M,K,N = {res['shape']}: {res['total_us']:.1f} us of GPU kernel time per step "
          f"(mean of {res['steps']} steps)")
    for c, v in res["categories_us"].items():
        print(f"   {c:18s} {v:9.1f} us  {100 * v / max(res['total_us'], 1e-9):5.1f}%")
    print("        us  launches  kernel  [hlo op]")
    for r in res["kernels"][:top]:
        print(f"  {r['us']:8.1f}  {r['launches']:8.1f}  {r['name'][:80]}  [{r['hlo_op'][:40]}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="bf16,nvfp4-fwd-mxfp8-bwd")
    ap.add_argument("--shape", default="16384,4096,4096", help="M tokens, K, N")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    m, k, n = map(int, a.shape.split(","))
    results = [profile(r.strip(), m, k, n, a.steps) for r in a.recipes.split(",")]
    for res in results:
        report(res, a.top)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
