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
