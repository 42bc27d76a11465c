"""Per-kernel GPU time of one Dense training step (benchmarks/dense.py's step) for one recipe, under Nsight Compute.

Usage on the device machine (from /tmp, with the package installed in PYTHONPATH):
  ncu --metrics gpu__time_duration.sum --csv python3 -P tools/profile_dense.py --recipe nvfp4-fwd-mxfp8-bwd \
      > ncu_dense.csv
  python3 -P tools/profile_dense.py --summarize ncu_dense.csv
The script runs the compiled step twice (warm-up, then the profiled step) with a tiny sort between them as a marker;
the summary keeps the launches after the marker and sums their durations by kernel name.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import sys


def run(recipe: str, m: int, k: int, n: int) -> None:
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, __file__.rsplit("/tools/", 1)[0] + "/benchmarks")
    import dense as bench  # benchmarks/dense.py

    layer = bench.all_layers()[recipe]
    step = bench.make_step(layer)
    (x, w, b, g, key), = bench.make_argsets(m, k, n, 1)
    jax.block_until_ready(step(x, w, b, g, key))  # compile + warm-up
    jax.block_until_ready(jax.jit(jnp.sort)(jnp.arange(7.0)))  # marker: the step itself sorts nothing
    jax.block_until_ready(step(x, w, b, g, key))


def summarize(path: str) -> None:
    text = open(path).read()
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    launches = collections.OrderedDict()
    for r in rows:
        if r.get("Metric Name") == "gpu__time_duration.sum":
            launches[int(r["ID"])] = (r["Kernel Name"], float(r["Metric Value"].replace(",", "")), r.get("Metric Unit", ""))
    ids = sorted(launches)
    marks = [i for i in ids if "sort" in launches[i][0].lower()]
    last = [i for i in ids if not marks or i > marks[-1]]
    total = collections.Counter()
    count = collections.Counter()
    unit = ""
    for i in last:
        name, v, unit = launches[i]
        total[name[:90]] += v
        count[name[:90]] += 1
    s = sum(total.values())
    assert unit in ("nsecond", ""), unit
    print(f"{len(last)} launches in the profiled step, {s / 1e3:.1f} us of kernel time")
    print("      us  share  launches  kernel")
    for name, v in total.most_common(40):
        print(f"{v / 1e3:8.1f}  {100 * v / s:5.1f}%  x{count[name]:<3d}     {name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="nvfp4-fwd-mxfp8-bwd")
    ap.add_argument("--shape", default="16384,4096,4096", help="M tokens, K, N")
    ap.add_argument("--summarize", default=None, help="ncu --csv output to summarise")
    a = ap.parse_args()
    if a.summarize:
        summarize(a.summarize)
    else:
        run(a.recipe, *map(int, a.shape.split(",")))


if __name__ == "__main__":
    main()
