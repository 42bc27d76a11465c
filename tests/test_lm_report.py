"""examples/lm/lm_report.py's comparison plot: one colour per recipe, and the single-seed noise band from the bf16
train loss."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "lm"))
lm_report = pytest.importorskip("lm_report")
pytest.importorskip("matplotlib")


def test_loss_noise_pct():
    rng = np.random.default_rng(0)
    level, sigma = 2.0, 0.02
    losses = list(level + sigma * rng.standard_normal(4000))
    assert abs(lm_report.loss_noise_pct(losses) - 100 * sigma / level) < 0.05  # 1 % of the level
    assert lm_report.loss_noise_pct([1.0] * 5) is None
    assert lm_report.loss_noise_pct(list(np.linspace(3, 2, 40))) < 1e-6  # a smooth decline is no noise


def test_peak_of_earlier_run():
    """A process keeps one peak statistic: a second run whose peak stays below the first's reports the first's."""
    gib = 1 << 30
    assert lm_report.peak_of_earlier_run([55 * gib, 55 * gib], [55 * gib, 55 * gib])  # no device rose
    assert not lm_report.peak_of_earlier_run([55 * gib, 55 * gib], [55 * gib, 57 * gib])  # this run set one
    assert not lm_report.peak_of_earlier_run([0, 0], [51 * gib, 51 * gib])  # the first run
    assert not lm_report.peak_of_earlier_run(None, None)  # the CPU keeps no statistics
    assert not lm_report.peak_of_earlier_run(None, [gib])


def test_plot_has_a_colour_per_recipe_and_the_noise_band(tmp_path):
    rng = np.random.default_rng(1)
    names = ["bf16", "mxfp8", "nvfp4", "nvfp4-1x64", "nvfp4-fwd-mxfp8-bwd"]
    rows = []
    for i, name in enumerate(names):
        for step in range(40):
            train = 3 - step / 40 + 0.03 * rng.standard_normal()
            rows.append({"step": str(step), "recipe": name, "train_loss": str(train),
                         "val_loss": str(3 - step / 40 + 0.001 * i) if step % 10 == 9 else ""})
    info = lm_report.plot_curves(tmp_path, rows, "test")
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert len({tuple(c) for c in info["colors"].values()}) == len(names)
    assert info["noise_pct"] is not None and 0.5 < info["noise_pct"] < 2.5
    assert info["ylabel"] == "loss (nats per byte)"
    assert lm_report.plot_curves(tmp_path, rows, "test", unit="token")["ylabel"] == "loss (nats per token)"


def test_diagnostics_rows_csv_and_heatmaps(tmp_path):
    """diagnostic_rows flattens stacked statistics into one row per (layer index, operand); write_diagnostics
    replaces a run's rows in diagnostics.csv (other runs kept) and draws its heatmaps."""
    import csv

    from jax_fp4.diagnostics import OPERANDS, STATS

    stats = {"blocks/up": np.arange(2 * 36, dtype=np.float32).reshape(2, 6, 6), "head": np.full((6, 6), np.inf)}
    rows = lm_report.diagnostic_rows(stats, step=7, run="a", phase=0)
    assert [r["layer"] for r in rows[::6]] == ["blocks/up[0]", "blocks/up[1]", "head"]
    for r in rows[:12]:
        i, j = int(r["layer"][-2]), OPERANDS.index(r["operand"])
        assert [r[k] for k in STATS] == list(stats["blocks/up"][i, j]) and r["step"] == 7 and r["run"] == "a"
    lm_report.write_diagnostics(tmp_path, "a", rows)
    lm_report.write_diagnostics(tmp_path, "b", lm_report.diagnostic_rows({"head": stats["head"]}, step=3, run="b"))
    lm_report.write_diagnostics(tmp_path, "a", rows[6:])  # replaces a's rows
    with (tmp_path / "diagnostics.csv").open(newline="") as f:
        runs = [r["run"] for r in csv.DictReader(f)]
    assert runs.count("a") == len(rows) - 6 and runs.count("b") == 6
    assert (tmp_path / "diagnostics_a.png").stat().st_size > 1000
    assert (tmp_path / "diagnostics_b_saturated.png").is_file()
    with pytest.raises(ValueError, match="stat must be one of"):
        lm_report.plot_heatmap(tmp_path / "x.png", rows, "snr")
