"""Statistics of train_lm / precision_study results: paired gaps to bf16 over seeds with Student-t confidence
intervals, the validation loss's own standard error, and the same-seed spread of repeated runs.

Run names: "<configuration>@s<seed>" (`split_name`); "bf16@s<seed>" is the reference of every configuration's run of
that seed, and a repeat of a run with the same seed is named "<configuration>+repeat<k>@s<seed>" (precision_study
--repeat-bf16). Every run of a seed starts from the same initial weights and sees the same batches (train_lm's
seed), so a configuration's gap is *paired* per seed:

  gap_s = 100 (L_cfg,s / L_bf16,s - 1)  [%],   mean over seeds ± t_{0.975, n-1} · sd(gap_s) / sqrt(n)

(Student's t interval at 95 %, n seeds). A gap whose interval contains 0 is "unresolved"; one seed gives no interval.
For planning, `seeds_needed` turns a configuration's seed sd into the number of seeds whose interval would reach a
target half-width (TARGET_HALF_PCT, ±0.3 % by default).

Beside it, two noise figures:
  * eval_se_pct: the evaluation noise of the mean gap. The validation set is the same windows in every run, so each
    seed's gap has a paired standard error from the per-sequence loss differences d_i = l_cfg,i - l_bf16,i:
    se_s = 100 sd(d) / (sqrt(m) L_bf16,s) over the m sequences; the mean gap's is sqrt(sum_s se_s^2) / n.
  * same_seed_spread_pct: how far two runs of one seed and configuration end apart (max over the repeated pairs,
    100 |L_repeat / L - 1|). It is what one seed's gap can be off by from run-to-run nondeterminism alone, and 0
    for deterministic runs (`--deterministic`).
  * pre_switch_spread_pct: the same kind of figure for a configuration C that also ran as "C+switch<f>" with the
    same seed: the two runs compute the same steps until the switch, so their validation losses at the last common
    evaluation before it differ only by run-to-run nondeterminism (max over seeds of 100 |L_switch / L_C - 1|; needs
    each summary's "val_curve", [[step, val_loss], ...], which precision_study attaches from curves.csv). It costs no
    extra run and measures the quantized configuration's own noise, which can exceed bf16's.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
TARGET_HALF_PCT = 0.3  # the interval half-width a gap table aims for (%); seeds_needed's default target
SEEDS_LIMIT = 1000
REPEAT = re.compile(r"(.*)\+repeat(\d+)")
SWITCH = re.compile(r"(.*)\+switch[0-9.]+")
SWITCH_STEP = re.compile(r"from step (\d+)")  # train_lm's summary["switch"]: "... from step 900 of 1000"


def split_name(name: str) -> tuple[str, int | None]:
    """(configuration, seed) of a run name ("x@s3" -> ("x", 3); "x" -> ("x", None))."""
    m = re.fullmatch(r"(.*)@s(-?\d+)", name)
    return (m[1], int(m[2])) if m else (name, None)


def standard_error(samples) -> float:
    """sd(samples, ddof=1) / sqrt(n) of a 1D sample (nan for fewer than 2)."""
    x = np.asarray(samples, np.float64).ravel()
    return float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else math.nan


def t_interval(samples, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """(mean, half-width) of Student's t confidence interval of the mean of `samples`; half-width nan for n < 2.
    Source: the t interval mean ± t_{(1+c)/2, n-1} s / sqrt(n) (scipy.stats.t.ppf for the quantile)."""
    x = np.asarray(samples, np.float64).ravel()
    if x.size < 2:
        return (float(x.mean()) if x.size else math.nan), math.nan
    return float(x.mean()), float(stats.t.ppf((1 + confidence) / 2, x.size - 1) * standard_error(x))


def welch_interval(a, b, confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(mean(b) - mean(a), low, high): the confidence interval of the difference of two means from independent
    samples whose variances may differ (nan bounds when either has fewer than 2 values; the difference itself when
    both variances are 0). Source: Welch's t interval, d ± t_{(1+c)/2, v} sqrt(u_a + u_b) with u = s^2/n, and the
    Welch-Satterthwaite degrees of freedom v = (u_a + u_b)^2 / (u_a^2/(n_a - 1) + u_b^2/(n_b - 1)) (scipy.stats.t.ppf
    for the quantile)."""
    x, y = (np.asarray(v, np.float64).ravel() for v in (a, b))
    d = float(y.mean() - x.mean()) if x.size and y.size else math.nan
    if x.size < 2 or y.size < 2:
        return d, math.nan, math.nan
    va, vb = x.var(ddof=1) / x.size, y.var(ddof=1) / y.size
    if va + vb == 0:
        return d, d, d
    dof = (va + vb) ** 2 / (va ** 2 / (x.size - 1) + vb ** 2 / (y.size - 1))
    half = float(stats.t.ppf((1 + confidence) / 2, dof) * math.sqrt(va + vb))
    return d, d - half, d + half


def seeds_needed(sd: float, half: float = TARGET_HALF_PCT, confidence: float = CONFIDENCE,
                 limit: int = SEEDS_LIMIT) -> int | None:
    """The smallest n >= 2 with t_{(1+c)/2, n-1} sd / sqrt(n) <= half: how many seeds a Student-t interval needs to
    reach half-width `half` (same unit as `sd`, e.g. %) if the seed-to-seed sd stays `sd`. None when `sd` is not
    finite or n would exceed `limit`. A planning figure: an sd from few seeds is itself uncertain (from 3 seeds, a
    95 % interval of 0.52-6.3 times the estimate, chi-square with 2 degrees of freedom).
    Raises ValueError for half <= 0."""
    if not half > 0:
        raise ValueError(f"seeds_needed: the target half-width must be > 0, got {half}")
    if sd is None or not math.isfinite(sd):
        return None
    q = (1 + confidence) / 2
    for n in range(2, limit + 1):
        if stats.t.ppf(q, n - 1) * sd / math.sqrt(n) <= half:
            return n
    return None


def same_seed_spread(summaries: dict) -> dict:
    """{configuration: spread %} from repeated runs "<cfg>+repeat<k>@s<seed>" against "<cfg>@s<seed>": the largest
    100 |L_repeat / L - 1| over the pairs found (configurations without repeats are left out)."""
    out: dict = {}
    for name, s in summaries.items():
        base, seed = split_name(name)
        m = REPEAT.fullmatch(base)
        first = summaries.get(f"{m[1]}@s{seed}") if m else None
        if first is None:
            continue
        out[m[1]] = max(out.get(m[1], 0.0), 100 * abs(s["val_loss"] / first["val_loss"] - 1))
    return out


def pre_switch_spread(summaries: dict) -> dict:
    """{configuration C: spread %} from the pairs "C@s<seed>" / "C+switch<f>@s<seed>" (module docstring): at the
    last evaluation step both val_curves hold before the switch step, the largest 100 |L_switch / L_C - 1| over the
    seeds (pairs without curves, switch step or a common evaluation before it are left out)."""
    out: dict = {}
    for name, s in summaries.items():
        cfg, seed = split_name(name)
        m = SWITCH.fullmatch(cfg)
        base = summaries.get(f"{m[1]}@s{seed}") if m and seed is not None else None
        at = SWITCH_STEP.search(str(s.get("switch") or ""))
        if base is None or at is None or not s.get("val_curve") or not base.get("val_curve"):
            continue
        before = {int(k): v for k, v in base["val_curve"] if int(k) < int(at[1])}
        common = [(int(k), v) for k, v in s["val_curve"] if int(k) in before]
        if not common:
            continue
        step, value = max(common)
        out[m[1]] = max(out.get(m[1], 0.0), 100 * abs(value / before[step] - 1))
    return out


def _paired_eval_se_pct(run: dict, ref: dict) -> float:
    a, b = run.get("val_seq_losses"), ref.get("val_seq_losses")
    if not a or not b or len(a) != len(b):
        return math.nan
    return 100 * standard_error(np.subtract(a, b)) / ref["val_loss"]


def seed_gaps(summaries: dict, confidence: float = CONFIDENCE, target_half_pct: float = TARGET_HALF_PCT) -> dict:
    """{configuration: gap record} over the seeded runs of `summaries` ({run name: summary with "val_loss" and, for
    the evaluation noise, "val_seq_losses"}); each gap against the bf16 run of the same seed, repeats left out.

    A record: seeds, gaps_pct (per seed), mean_pct, std_pct (over seeds), min_pct, max_pct, val_loss_mean,
    ci_half_pct, ci_low_pct, ci_high_pct (the `t_interval` at `confidence`), resolved (the interval excludes 0),
    eval_se_pct (the evaluation noise of the mean gap), same_seed_spread_pct (of the configuration's repeats, else of
    bf16's, else None), pre_switch_spread_pct (`pre_switch_spread`, else None), deterministic (every run of the
    record was), target_half_pct and seeds_needed (`seeds_needed` of std_pct for that half-width; None for one
    seed or bf16)."""
    ref = {split_name(n)[1]: s for n, s in summaries.items() if split_name(n)[0] == "bf16"}
    spread, pre = same_seed_spread(summaries), pre_switch_spread(summaries)
    by_cfg: dict = {}
    for n, s in summaries.items():
        cfg, seed = split_name(n)
        if seed is None or REPEAT.fullmatch(cfg):
            continue
        by_cfg.setdefault(cfg, {})[seed] = s
    out = {}
    for cfg, runs in by_cfg.items():
        seeds = sorted(s for s in runs if s in ref)
        if not seeds:
            continue
        gaps = np.array([100 * (runs[s]["val_loss"] / ref[s]["val_loss"] - 1) for s in seeds])
        mean, half = t_interval(gaps, confidence)
        se = [_paired_eval_se_pct(runs[s], ref[s]) for s in seeds] if cfg != "bf16" else [0.0] * len(seeds)
        det = all(runs[s].get("deterministic") and ref[s].get("deterministic") for s in seeds)
        out[cfg] = {"seeds": seeds, "gaps_pct": gaps.tolist(), "mean_pct": mean,
                    "std_pct": float(gaps.std(ddof=1)) if gaps.size > 1 else math.nan,
                    "min_pct": float(gaps.min()), "max_pct": float(gaps.max()),
                    "val_loss_mean": float(np.mean([runs[s]["val_loss"] for s in seeds])),
                    "ci_half_pct": half, "ci_low_pct": mean - half, "ci_high_pct": mean + half,
                    "resolved": bool(cfg != "bf16" and math.isfinite(half) and (mean - half > 0 or mean + half < 0)),
                    "eval_se_pct": float(math.sqrt(np.sum(np.square(se))) / len(se)),
                    "same_seed_spread_pct": 0.0 if det else spread.get(cfg, spread.get("bf16")),
                    "pre_switch_spread_pct": pre.get(cfg), "deterministic": det,
                    "target_half_pct": target_half_pct,
                    "seeds_needed": (seeds_needed(float(gaps.std(ddof=1)), target_half_pct, confidence)
                                     if cfg != "bf16" and gaps.size > 1 else None)}
    return out


def status(g: dict) -> str:
    """"resolved", "unresolved" (the interval contains 0) or "one seed" of a `seed_gaps` record."""
    if len(g["seeds"]) < 2:
        return "one seed"
    return "resolved" if g["resolved"] else "unresolved"


def format_gaps(gaps: dict) -> str:
    """A table of `seed_gaps`: mean gap with its 95 % interval, the spreads, the seeds the interval would need to
    reach ±target_half_pct (n@±...%) and whether the gap is resolved."""
    pct = lambda v: "n/a" if v is None or not math.isfinite(v) else f"{v:.2f}"  # noqa: E731
    target = next((g["target_half_pct"] for g in gaps.values()), TARGET_HALF_PCT)
    lines = [f"{'configuration':<46} {'seeds':>5} {'val loss':>9} {'gap mean':>9} {'95% CI':>17} {'seed sd':>7} "
             f"{'eval se':>7} {'same-seed':>9} {'pre-switch':>10} {f'n@±{target:g}%':>9}  status"]
    for cfg, g in gaps.items():
        ci = ("" if not math.isfinite(g["ci_half_pct"]) else
              f"[{g['ci_low_pct']:+.2f}, {g['ci_high_pct']:+.2f}]")
        lines.append(f"{cfg:<46} {len(g['seeds']):>5} {g['val_loss_mean']:>9.4f} {g['mean_pct']:>+8.2f}% {ci:>17} "
                     f"{pct(g['std_pct']):>7} {pct(g['eval_se_pct']):>7} {pct(g['same_seed_spread_pct']):>9} "
                     f"{pct(g.get('pre_switch_spread_pct')):>10} "
                     f"{_count(g.get('seeds_needed'), g, cfg):>9}  "
                     f"{'reference' if cfg == 'bf16' else status(g)}")
    return "\n".join(lines)


def _count(n, g: dict, cfg: str) -> str:
    if cfg == "bf16" or len(g["seeds"]) < 2:
        return "n/a"
    return str(n) if n is not None else f">{SEEDS_LIMIT}"


FIELDS = ("configuration", "seeds", "val_loss_mean", "gap_mean_pct", "ci95_low_pct", "ci95_high_pct",
          "ci95_half_pct", "gap_std_pct", "gap_min_pct", "gap_max_pct", "eval_se_pct", "same_seed_spread_pct",
          "pre_switch_spread_pct", "target_half_pct", "seeds_needed", "status")


def write_gaps(out: Path, gaps: dict):
    """OUT/gaps.json (the records) and OUT/gaps.csv (FIELDS, one row per configuration)."""
    (out / "gaps.json").write_text(json.dumps(gaps, indent=1))
    with (out / "gaps.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(FIELDS)
        for cfg, g in gaps.items():
            w.writerow([cfg, " ".join(map(str, g["seeds"])), g["val_loss_mean"], g["mean_pct"], g["ci_low_pct"],
                        g["ci_high_pct"], g["ci_half_pct"], g["std_pct"], g["min_pct"], g["max_pct"],
                        g["eval_se_pct"], g["same_seed_spread_pct"], g.get("pre_switch_spread_pct"),
                        g.get("target_half_pct"), g.get("seeds_needed"),
                        "reference" if cfg == "bf16" else status(g)])


def plot_gaps(out: Path, gaps: dict, title: str) -> Path | None:
    """OUT/gaps.png: each configuration's mean gap with its 95 % interval (filled marker: resolved; hollow:
    unresolved or one seed), the same-seed spread of bf16 as a grey band around 0; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [(c, g) for c, g in gaps.items() if c != "bf16"]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.6))
    spread = next((g["same_seed_spread_pct"] for g in gaps.values() if g["same_seed_spread_pct"]), None)
    if spread:
        ax.axvspan(-spread, spread, color="0.85", label=f"same-seed spread ±{spread:.2f} %")
    ax.axvline(0, color="0.4", lw=0.8)
    for i, (_, g) in enumerate(rows):
        half = g["ci_half_pct"] if math.isfinite(g["ci_half_pct"]) else 0.0
        ax.errorbar(g["mean_pct"], i, xerr=half, fmt="o", color="C0", capsize=3,
                    mfc="C0" if g["resolved"] else "white")
        ax.plot(g["gaps_pct"], [i] * len(g["gaps_pct"]), "x", color="0.5", ms=4)
    ax.set_yticks(range(len(rows)), [f"{c} ({status(g)})" for c, g in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("gap to bf16 (%): mean over seeds, 95 % t interval; x: the seeds")
    ax.set_title(title, fontsize=9)
    if spread:
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = out / "gaps.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
