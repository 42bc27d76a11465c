"""The gap to bf16 against model size: one line per configuration, each point the mean gap over seeds with its 95 %
Student-t interval, from the output directories of precision_study.py runs at several presets.

    python examples/lm/gap_scaling.py runs/study-small runs/study-medium runs/study-350m --out runs/gap_scaling

Each directory holds precision_study's summary.json (every run's "params") and is reduced by `lm_stats.seed_gaps`;
writes OUT/gap_scaling.png and OUT/gap_scaling.csv (configuration, parameters, seeds, mean, interval, status,
deterministic, training tokens per parameter, also written under each size), OUT/size_changes.csv (how each
configuration's gap changes from one measured size to the next, with a Welch interval: `size_changes`) and prints both.
A point whose interval contains 0 is drawn hollow (unresolved); a study whose runs were not all deterministic
(`--deterministic`) is drawn with square markers and labelled so under its size, since its intervals also hold the runs'
own noise. The configurations' points at one size are spread sideways by a few percent of the size so that their
intervals do not hide each other; a configuration's line breaks at a size where it was not measured.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lm_stats  # noqa: E402


def collect(dirs) -> list[dict]:
    """One row per (study, configuration but bf16): params, seeds, mean_pct, ci_low_pct, ci_high_pct, status,
    deterministic (every run of the configuration and of its bf16 references was), tokens_per_param (the bf16 runs'
    training tokens, steps x tokens_per_step, per parameter; nan where the summaries lack them): gaps at different
    sizes are compared at different points of training unless it matches."""
    rows = []
    for d in map(Path, dirs):
        summaries = json.loads((d / "summary.json").read_text())
        params = {s["params"] for s in summaries.values() if "params" in s}
        if len(params) != 1:
            raise ValueError(f"{d}: the runs disagree on (or lack) the parameter count: {sorted(params)}")
        n = params.pop()
        tokens = {s["steps"] * s["tokens_per_step"] for name, s in summaries.items()
                  if lm_stats.split_name(name)[0] == "bf16" and "steps" in s and "tokens_per_step" in s}
        per_param = tokens.pop() / n if len(tokens) == 1 else math.nan
        for cfg, g in lm_stats.seed_gaps(summaries).items():
            if cfg != "bf16":
                rows.append({"study": str(d), "configuration": cfg, "params": n, "seeds": len(g["seeds"]),
                             "mean_pct": g["mean_pct"], "ci_low_pct": g["ci_low_pct"], "ci_high_pct": g["ci_high_pct"],
                             "status": lm_stats.status(g), "deterministic": bool(g["deterministic"]),
                             "tokens_per_param": per_param, "gaps_pct": list(g["gaps_pct"])})
    return sorted(rows, key=lambda r: (r["configuration"], r["params"]))


def size_changes(rows: list[dict]) -> list[dict]:
    """Per configuration and pair of consecutive sizes at which it was measured: change_pct, the later mean gap minus
    the earlier (percentage points), with its 95 % Welch interval over the two sizes' per-seed gaps
    (lm_stats.welch_interval; the seeds of different sizes are independent runs) and status "resolved" when the
    interval excludes 0; deterministic when both studies were."""
    out = []
    for cfg in dict.fromkeys(r["configuration"] for r in rows):
        pts = sorted((r for r in rows if r["configuration"] == cfg), key=lambda r: r["params"])
        for a, b in zip(pts[:-1], pts[1:], strict=True):
            d, lo, hi = lm_stats.welch_interval(a["gaps_pct"], b["gaps_pct"])
            out.append({"configuration": cfg, "from_params": a["params"], "to_params": b["params"], "change_pct": d,
                        "ci_low_pct": lo, "ci_high_pct": hi,
                        "status": "resolved" if lo > 0 or hi < 0 else "unresolved",
                        "deterministic": a["deterministic"] and b["deterministic"]})
    return out


def line(rows: list[dict], cfg: str) -> tuple[list[float], list[float]]:
    """(sizes, mean gaps) of cfg's line over every size in rows, ascending, nan where cfg was not measured at a size:
    the drawn line breaks there instead of joining the sizes around it as if it had passed through."""
    sizes = sorted({r["params"] for r in rows})
    means = {r["params"]: r["mean_pct"] for r in rows if r["configuration"] == cfg}
    return sizes, [means.get(n, math.nan) for n in sizes]


def plot(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.axhline(0, color="0.4", lw=0.8)
    ax.set_xscale("log")
    cfgs = list(dict.fromkeys(r["configuration"] for r in rows))
    for i, cfg in enumerate(cfgs):
        pts = [r for r in rows if r["configuration"] == cfg]
        shift = 10 ** (0.025 * (i - (len(cfgs) - 1) / 2))
        x = [r["params"] * shift for r in pts]
        y = [r["mean_pct"] for r in pts]
        err = [[r["mean_pct"] - r["ci_low_pct"] if math.isfinite(r["ci_low_pct"]) else 0 for r in pts],
               [r["ci_high_pct"] - r["mean_pct"] if math.isfinite(r["ci_high_pct"]) else 0 for r in pts]]
        lx, ly = line(rows, cfg)
        ax.plot([n * shift for n in lx], ly, "-", color=f"C{i}", label=cfg, lw=1)
        for r, xe, ye, lo, hi in zip(pts, x, y, *err, strict=True):
            ax.errorbar(xe, ye, yerr=[[lo], [hi]], fmt="o" if r["deterministic"] else "s", color=f"C{i}", capsize=3,
                        mfc=f"C{i}" if r["status"] == "resolved" else "white")
    sizes = {r["params"]: (r["deterministic"], r["tokens_per_param"]) for r in rows}
    ax.set_xticks(list(sizes), [f"{n / 1e6:.1f}M" + (f", {tpp:.2g} tokens/param" if math.isfinite(tpp) else "")
                                + f"\n{'deterministic' if det else 'not deterministic'}"
                                for n, (det, tpp) in sizes.items()], fontsize=8)
    ax.minorticks_off()
    ax.set_xlim(min(sizes) / 2, max(sizes) * 2)
    ax.set_xlabel("parameters")
    ax.set_ylabel("validation-loss gap to bf16 (%), 95 % interval")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("studies", nargs="+", type=Path, help="precision_study.py output directories")
    p.add_argument("--out", type=Path, default=Path("runs/gap_scaling"))
    args = p.parse_args(argv)
    rows = collect(args.studies)
    changes = size_changes(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, table in (("gap_scaling.csv", [{k: v for k, v in r.items() if k != "gaps_pct"} for r in rows]),
                        ("size_changes.csv", changes)):
        with (args.out / name).open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]) if table else ["configuration"])
            w.writeheader()
            w.writerows(table)
    plot(rows, args.out / "gap_scaling.png")
    for r in rows:
        print(f"{r['configuration']:<44} {r['params'] / 1e6:>9.1f}M {r['seeds']:>2} seeds {r['mean_pct']:+6.2f}% "
              f"[{r['ci_low_pct']:+.2f}, {r['ci_high_pct']:+.2f}] {r['status']}"
              f"{'' if r['deterministic'] else ' (not deterministic)'}")
    if changes:
        print("change of the gap with size (points; 95 % Welch interval):")
    for c in changes:
        print(f"{c['configuration']:<44} {c['from_params'] / 1e6:>7.1f}M -> {c['to_params'] / 1e6:.1f}M "
              f"{c['change_pct']:+6.2f} [{c['ci_low_pct']:+.2f}, {c['ci_high_pct']:+.2f}] {c['status']}"
              f"{'' if c['deterministic'] else ' (not deterministic)'}")
    return rows


if __name__ == "__main__":
    main()
