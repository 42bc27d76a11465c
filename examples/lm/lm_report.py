"""Outputs of a train_lm.py run: curves.csv (merged across invocations), curves.png, the summary table, and the
device metrics that summary.json records (peak memory per device, collective bytes of the compiled step)."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import jax
import lm_precision
import numpy as np

CSV_FIELDS = ("step", "recipe", "train_loss", "val_loss", "tokens_per_s", "aux_loss", "phase")


def peak_memory() -> list[int] | None:
    """Peak bytes in use on each device since the process started (`Device.memory_stats()["peak_bytes_in_use"]`),
    None where the backend keeps no statistics (the CPU)."""
    peaks = []
    for d in jax.local_devices():
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - backends without statistics raise various errors
            stats = None
        if not stats or "peak_bytes_in_use" not in stats:
            return None
        peaks.append(int(stats["peak_bytes_in_use"]))
    return peaks


def write_curves(out: Path, rows: list[dict], replaced: set[str]) -> list[dict]:
    """Merge rows into out/curves.csv (rows of the recipes in `replaced` are dropped first); returns all rows."""
    path = out / "curves.csv"
    old = []
    if path.is_file():
        with path.open(newline="") as f:
            old = [r for r in csv.DictReader(f) if r.get("recipe") not in replaced]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in old + rows:
            w.writerow({k: ("" if r.get(k) is None else r[k]) for k in CSV_FIELDS})
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def loss_noise_pct(losses: list[float]) -> float | None:
    """The step-to-step noise of a train-loss curve, in % of its level: the standard deviation of the differences of
    consecutive losses over the last half of the run, / sqrt(2) (the noise of one step's loss when consecutive steps
    are independent draws around a slowly moving mean), / the mean loss there. None with fewer than 8 points."""
    tail = np.asarray(losses[len(losses) // 2:], np.float64)
    if len(tail) < 8:
        return None
    return float(100 * np.std(np.diff(tail)) / np.sqrt(2) / np.mean(tail))


def plot_curves(out: Path, rows: list[dict], title: str):
    """out/curves.png. Left: train loss (thin, dotted) and validation loss (markers) per recipe against the step, one
    colour per recipe (tab10); right: each recipe's validation loss relative to bf16's at the same step (when bf16 is
    among the rows), over a grey band of +-the bf16 train loss's step-to-step noise (`loss_noise_pct`): with one seed,
    gaps inside it are not results (--seeds gives a mean and spread)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def curve(name, key):
        pts = [(int(r["step"]), float(r[key])) for r in rows if r["recipe"] == name and r[key] not in ("", None)]
        return [p[0] for p in pts], [p[1] for p in pts]

    names = list(dict.fromkeys(r["recipe"] for r in rows))
    colors = {n: plt.get_cmap("tab10" if len(names) <= 10 else "tab20")(i) for i, n in enumerate(names)}
    fig, (ax, gap) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=110)
    ref = dict(zip(*curve("bf16", "val_loss"), strict=True)) if "bf16" in names else {}
    noise = loss_noise_pct(curve("bf16", "train_loss")[1]) if ref else None
    if noise is not None:
        gap.axhspan(-noise, noise, color="0.88", zorder=0,
                    label=f"±{noise:.2f}%: bf16 train-loss noise per step (one seed)")
    for name in names:
        ax.plot(*curve(name, "train_loss"), color=colors[name], alpha=0.6, lw=0.9, ls=":")
        steps, val = curve(name, "val_loss")
        ax.plot(steps, val, "o-", color=colors[name], ms=3, lw=1.5, label=name)
        pts = [(s, 100 * (v / ref[s] - 1)) for s, v in zip(steps, val, strict=True) if s in ref]
        if pts and name != "bf16":
            gap.plot(*zip(*pts, strict=True), "o-", color=colors[name], ms=3, lw=1.5, label=name)
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title="validation (markers) and train (dotted) loss")
    gap.axhline(0.0, color="k", lw=0.8)
    gap.set(xlabel="step", ylabel="validation loss vs bf16 (%)", title="gap to bf16")
    if noise is not None:
        gap.text(0.01, 0.01, "one seed per recipe: gaps within the grey band are noise, not results;\n"
                 "--seeds S1 S2 ... gives each gap's mean and spread (gaps.csv)", transform=gap.transAxes,
                 fontsize=7, va="bottom", color="0.3")
    for a in (ax, gap):
        a.grid(alpha=0.3)
    ax.legend()
    if gap.lines[1:]:  # beyond the zero line
        gap.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "curves.png")
    plt.close(fig)
    return {"colors": {n: colors[n] for n in names}, "noise_pct": noise}


def format_table(summaries: dict) -> str:
    """Validation loss, bits per byte, the gap to bf16 (of the same seed), tokens/s (and its ratio to bf16's), step
    time (compiles, evaluations, checkpoints and diagnostics steps left out), MFU, the diagnostics step's time when
    there were some, and the wall time (everything, compiles included) of each run; with MoE runs, the last logged
    load-balancing loss too."""
    def ref(name):
        seed = lm_precision.split_name(name)[1]
        return summaries.get("bf16" if seed is None else f"bf16@s{seed}")

    aux = any(s.get("aux_loss") is not None for s in summaries.values())
    diag = any(s.get("diag_step_ms") is not None for s in summaries.values())
    w = max([20] + [len(n) for n in summaries])
    lines = [f"{'run':<{w}} {'steps':>6} {'val loss':>9} {'bits/byte':>9} {'vs bf16':>8} {'tokens/s':>10} "
             f"{'x bf16':>6} {'step ms':>8} {'MFU':>6} {'wall s':>7}" + (f" {'diag ms':>8}" if diag else "")
             + (f" {'aux':>6}" if aux else "")]
    for name, s in summaries.items():
        r = ref(name)
        gap = f"{100 * (s['val_loss'] / r['val_loss'] - 1):+.2f}%" if r else "n/a"
        tps = f"{s['tokens_per_s']:,.0f}" if math.isfinite(s["tokens_per_s"]) else "n/a"
        speed = (f"{s['tokens_per_s'] / r['tokens_per_s']:.3f}" if r and math.isfinite(s["tokens_per_s"])
                 and math.isfinite(r["tokens_per_s"]) else "n/a")
        ms = f"{s['step_ms']:.1f}" if math.isfinite(s["step_ms"]) else "n/a"
        mfu = f"{100 * s['mfu']:.1f}%" if s.get("mfu") else "n/a"
        lines.append(f"{name:<{w}} {s['steps']:>6} {s['val_loss']:>9.4f} {s['bits_per_byte']:>9.4f} {gap:>8} "
                     f"{tps:>10} {speed:>6} {ms:>8} {mfu:>6} {s['wall_s']:>7.1f}"
                     + (f" {s.get('diag_step_ms') or math.nan:>8.1f}" if diag else "")
                     + (f" {s['aux_loss']:>6.3f}" if aux and s.get("aux_loss") is not None else ""))
    return "\n".join(lines)


_COLLECTIVE = re.compile(r"=\s*(\([^=]*?\)|[a-z0-9]+\[[\d,]*\](?:\{[^}]*\})?)\s+"
                         r"(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-done)?\(")
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_BITS = {"pred": 8, "s8": 8, "u8": 8, "f8e4m3fn": 8, "f8e5m2": 8, "f8e8m0fnu": 8, "f4e2m1fn": 4, "s4": 4, "u4": 4,
         "bf16": 16, "f16": 16, "s16": 16, "u16": 16, "f32": 32, "s32": 32, "u32": 32, "f64": 64, "s64": 64}


def collective_bytes(hlo_text: str) -> dict:
    """{op: {"count", "bytes"}} of the collectives in a compiled module's HLO text (`compiled.as_text()`): every
    all-gather, all-reduce, reduce-scatter, all-to-all and collective-permute (asynchronous ones by their -done op),
    bytes = the size of its result (all-gather: the gathered array; reduce-scatter: one shard). An op inside a loop
    body (a scanned block stack) is counted once, not once per iteration: count unscanned models (--no-scan) for
    per-step totals."""
    out: dict = {}
    for m in _COLLECTIVE.finditer(hlo_text):
        op = out.setdefault(m[2], {"count": 0, "bytes": 0})
        op["count"] += 1
        for dtype, dims in _SHAPE.findall(m[1]):
            n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
            op["bytes"] += n * _BITS.get(dtype, 32) // 8
    return out
