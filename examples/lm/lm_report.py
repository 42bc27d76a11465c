"""Outputs of a train_lm.py run: curves.csv (merged across invocations), curves.png, the summary table, the
peak memory per device that summary.json records (the compiled step's collectives: `lm_collectives`), and the
quantization diagnostics (diagnostics.csv and the layer x operand heatmaps of `jax_fp4.diagnostics` statistics)."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import jax
import lm_stats
import numpy as np

from jax_fp4.diagnostics import OPERANDS, STATS

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


def peak_of_earlier_run(before: list[int] | None, after: list[int] | None) -> bool:
    """Whether the process peak `after` (peak_memory() at a run's end) is still the one `before` (at its start) held:
    no device's peak rose during the run, so the figure is an earlier run's and this run's own peak is at most it
    (the statistic cannot be reset)."""
    return bool(before and after) and all(a <= b for a, b in zip(after, before, strict=True))


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


def plot_curves(out: Path, rows: list[dict], title: str, unit: str = "byte"):
    """out/curves.png. Left: train loss (thin, dotted) and validation loss (markers) per recipe against the step, one
    colour per recipe (tab10), in nats per `unit` ("byte" or "token": what one loss term predicts); right: each
    recipe's validation loss relative to bf16's at the same step (when bf16 is among the rows), over a grey band of
    +-the bf16 train loss's step-to-step noise (`loss_noise_pct`): with one seed, gaps inside it are not results
    (--seeds gives a mean and spread)."""
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
    ax.set(xlabel="step", ylabel=f"loss (nats per {unit})", title="validation (markers) and train (dotted) loss")
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
    return {"colors": {n: colors[n] for n in names}, "noise_pct": noise, "ylabel": ax.get_ylabel()}


def format_table(summaries: dict) -> str:
    """Validation loss, bits per byte, the gap to bf16 (of the same seed), tokens/s (and its ratio to bf16's), step
    time (compiles, evaluations, checkpoints and diagnostics steps left out), MFU, the diagnostics step's time when
    there were some, and the wall time (everything, compiles included) of each run; with MoE runs, the last logged
    load-balancing loss too."""
    def ref(name):
        seed = lm_stats.split_name(name)[1]
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


# ---- quantization diagnostics ----------------------------------------------------------------------------------------
def diagnostic_rows(stats: dict, step: int | None = None, **extra) -> list[dict]:
    """CSV rows of {layer: float[..., 6, 6]} (`jax_fp4.flax.diagnostics.value_and_grad`'s statistics: rows
    `OPERANDS`, columns `STATS`): one row per (layer, operand) with the `STATS` columns after step, `extra` and
    layer / operand; a stacked layer (leading axes, e.g. scanned blocks [L, 6, 6]) gives one layer per index, named
    "path[i]"."""
    out = []
    for layer, s in stats.items():
        s = np.asarray(s, np.float64)
        for idx in np.ndindex(*s.shape[:-2]):
            name = layer + "".join(f"[{i}]" for i in idx)
            for j, op in enumerate(OPERANDS):
                row = {"step": step, **extra, "layer": name, "operand": op}
                row.update({k: float(s[idx + (j, c)]) for c, k in enumerate(STATS)})
                out.append(row)
    return out


def _natural(name: str):
    """Sort key reading the digit runs of a layer path as numbers (blocks/2 before blocks/10)."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name) if t]


def plot_heatmap(path: Path, rows: list[dict], stat: str = "snr_db", title: str = ""):
    """A layer x operand heatmap PNG of one statistic (the last row of each (layer, operand); unquantized operands,
    SNR +inf, left blank and labelled), with the values written in the cells.

    Raises:
      ValueError: `stat` is not one of `jax_fp4.diagnostics.STATS`.
    """
    if stat not in STATS:
        raise ValueError(f"plot_heatmap: stat must be one of {STATS}, got {stat!r}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = {(r["layer"], r["operand"]): float(r[stat]) for r in rows}
    layers = sorted(dict.fromkeys(k[0] for k in last), key=_natural)
    grid = np.array([[last.get((la, op), np.nan) for op in OPERANDS] for la in layers], np.float64)
    unquantized = np.isposinf(grid) if stat == "snr_db" else np.zeros(grid.shape, bool)
    grid[~np.isfinite(grid)] = np.nan
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(layers) + 1.8), dpi=110)
    im = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(OPERANDS)), OPERANDS, rotation=30, ha="right")
    ax.set_yticks(range(len(layers)), layers, fontsize=7)
    for (i, j), v in np.ndenumerate(grid):
        if np.isfinite(v):
            ax.text(j, i, f"{v:.1f}" if stat == "snr_db" else f"{v:.2g}", ha="center", va="center", fontsize=6,
                    color="w")
        elif unquantized[i, j]:
            ax.text(j, i, "unquantized", ha="center", va="center", fontsize=5, color="0.4")
    fig.colorbar(im, ax=ax, label=stat)
    ax.set_title(title or stat, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_diagnostics(out: Path, name: str, rows: list[dict]):
    """Replace run `name`'s rows in out/diagnostics.csv (`diagnostic_rows`, with a "run" column) and draw
    out/diagnostics_<name>.png (SNR per layer and operand at the last recorded step of the first phase, i.e. before a
    precision switch) and out/diagnostics_<name>_saturated.png; copy the SNR map to out/diagnostics.png."""
    if not rows:
        return
    path = out / "diagnostics.csv"
    old = []
    if path.is_file():
        with path.open(newline="") as f:
            old = [r for r in csv.DictReader(f) if r.get("run") != name]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in old + rows for k in r)))  # missing: ""
        w.writeheader()
        w.writerows(old + rows)
    first = min(int(r.get("phase") or 0) for r in rows)
    last = max(int(r["step"]) for r in rows if int(r.get("phase") or 0) == first)
    final = [r for r in rows if int(r["step"]) == last]
    plot_heatmap(out / f"diagnostics_{name}.png", final, "snr_db", f"{name}: quantization SNR (dB), step {last}")
    plot_heatmap(out / f"diagnostics_{name}_saturated.png", final, "saturated",
                 f"{name}: fraction of values saturated, step {last}")
    (out / "diagnostics.png").write_bytes((out / f"diagnostics_{name}.png").read_bytes())
