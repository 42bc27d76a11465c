"""examples/lm/lm_stats.py (gaps paired per seed, Student-t intervals, evaluation noise, same-seed spread) and the
harness flags that feed it (--val-tokens, --deterministic, precision_study --repeats).

Expected values are computed here from their definitions (numpy, and scipy's t quantile checked against the
tabulated t_{0.975, 2} = 4.303), not copied from the code under test."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "lm"))

import lm_stats  # noqa: E402


def _run(val, seq=None, det=False):
    return {"val_loss": val, "val_seq_losses": seq, "deterministic": det}


def _write_runs(out: Path, runs) -> None:
    """OUT/runs/<name>/summary.json of each (name, validation loss), as a finished train_lm run writes it."""
    for name, val in runs:
        (out / "runs" / name).mkdir(parents=True, exist_ok=True)
        (out / "runs" / name / "summary.json").write_text(json.dumps({name: _run(val)}))


def test_t_interval_and_standard_error():
    x = [1.0, 2.0, 4.0]
    mean, half = lm_stats.t_interval(x)
    assert mean == pytest.approx(7 / 3)
    assert half == pytest.approx(4.302653 * np.std(x, ddof=1) / math.sqrt(3), rel=1e-6)
    assert lm_stats.standard_error([2.0, 4.0]) == pytest.approx(math.sqrt(2) / math.sqrt(2))
    assert math.isnan(lm_stats.t_interval([1.0])[1]) and math.isnan(lm_stats.standard_error([1.0]))


def test_welch_interval():
    """Equal variances and sizes give 2(n - 1) degrees of freedom (t_{0.975, 4} = 2.776445); unequal ones the
    Welch-Satterthwaite value, 50/17 for these samples; fewer than 2 values give nan bounds, no spread a point."""
    d, lo, hi = lm_stats.welch_interval([0.0, 1.0, 2.0], [1.0, 2.0, 3.0])
    assert d == pytest.approx(1.0) and (hi - d) == pytest.approx(d - lo) == pytest.approx(2.776445 * math.sqrt(2 / 3))
    from scipy import stats

    d, lo, hi = lm_stats.welch_interval([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])
    assert d == pytest.approx(2.0) and hi - d == pytest.approx(stats.t.ppf(0.975, 50 / 17) * math.sqrt(5 / 3))
    assert lm_stats.welch_interval([1.0, 1.0], [2.0, 2.0, 2.0]) == (1.0, 1.0, 1.0)
    d, lo, hi = lm_stats.welch_interval([1.0], [2.0, 3.0])
    assert d == 1.5 and math.isnan(lo) and math.isnan(hi)


def test_seeds_needed():
    """The smallest n whose t half-width t_{0.975, n-1} sd / sqrt(n) reaches the target: checked against the
    definition at n and n - 1, plus the edges (sd 0, not finite, beyond the limit, a bad target)."""
    from scipy import stats

    half = lambda n, sd: stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)  # noqa: E731
    for sd, target in ((0.82, 0.3), (0.25, 0.3), (1.51, 0.3), (0.41, 0.3), (2.0, 0.5)):
        n = lm_stats.seeds_needed(sd, target)
        assert half(n, sd) <= target < (half(n - 1, sd) if n > 2 else math.inf)
    assert lm_stats.seeds_needed(0.82, 0.3) == 32 and lm_stats.seeds_needed(0.41, 0.3) == 10
    assert lm_stats.seeds_needed(0.0) == 2 and lm_stats.seeds_needed(math.nan) is None
    assert lm_stats.seeds_needed(100.0, 0.01) is None  # more than SEEDS_LIMIT seeds
    with pytest.raises(ValueError, match="half-width must be > 0"):
        lm_stats.seeds_needed(1.0, 0.0)


def test_seed_gaps_paired_interval_and_status():
    rng = np.random.default_rng(0)
    ref_seq = {s: rng.uniform(0.5, 1.5, 64) for s in range(3)}
    summ = {}
    for s in range(3):
        summ[f"bf16@s{s}"] = _run(float(ref_seq[s].mean()), ref_seq[s].tolist())
        d = rng.normal(0.02, 0.01, 64)  # a clear positive shift: resolved
        summ[f"a@s{s}"] = _run(float((ref_seq[s] + d).mean()), (ref_seq[s] + d).tolist())
        e = (-1) ** s * 0.01 + rng.normal(0, 1e-4, 64)  # +, -, +: an interval around 0
        summ[f"b@s{s}"] = _run(float((ref_seq[s] + e).mean()), (ref_seq[s] + e).tolist())
    summ["a@s7"] = _run(1.0)  # no bf16 of seed 7: left out
    summ["bf16+repeat1@s0"] = _run(summ["bf16@s0"]["val_loss"] * 1.003)  # same-seed spread 0.3 %
    g = lm_stats.seed_gaps(summ)
    assert set(g) == {"bf16", "a", "b"} and g["a"]["seeds"] == [0, 1, 2]
    gaps = np.array([100 * (summ[f"a@s{s}"]["val_loss"] / summ[f"bf16@s{s}"]["val_loss"] - 1) for s in range(3)])
    half = 4.302653 * gaps.std(ddof=1) / math.sqrt(3)
    assert g["a"]["mean_pct"] == pytest.approx(gaps.mean()) and g["a"]["ci_half_pct"] == pytest.approx(half, rel=1e-6)
    assert g["a"]["ci_low_pct"] == pytest.approx(gaps.mean() - half) and g["a"]["resolved"]
    assert not g["b"]["resolved"] and g["b"]["ci_low_pct"] < 0 < g["b"]["ci_high_pct"]
    assert lm_stats.status(g["a"]) == "resolved" and lm_stats.status(g["b"]) == "unresolved"
    # evaluation noise: per seed sd(d) / sqrt(64) / L_bf16, combined as sqrt(sum se^2) / n
    se = [100 * np.std(np.subtract(summ[f"a@s{s}"]["val_seq_losses"], ref_seq[s]), ddof=1) / 8
          / summ[f"bf16@s{s}"]["val_loss"] for s in range(3)]
    assert g["a"]["eval_se_pct"] == pytest.approx(math.sqrt(sum(v * v for v in se)) / 3, rel=1e-9)
    assert g["a"]["same_seed_spread_pct"] == pytest.approx(0.3, rel=1e-9)  # bf16's repeats
    assert not g["a"]["deterministic"]
    assert g["a"]["seeds_needed"] == lm_stats.seeds_needed(gaps.std(ddof=1), 0.3) and g["bf16"]["seeds_needed"] is None
    assert lm_stats.seed_gaps(summ, target_half_pct=0.05)["a"]["seeds_needed"] > g["a"]["seeds_needed"]
    table = lm_stats.format_gaps(g)
    assert "unresolved" in table and "reference" in table and f"{g['a']['ci_low_pct']:+.2f}" in table
    assert "n@±0.3%" in table


def test_one_seed_and_deterministic_runs(tmp_path):
    summ = {"bf16@s0": _run(1.0, det=True), "x@s0": _run(1.02, det=True), "bf16+repeat1@s0": _run(1.0, det=True)}
    g = lm_stats.seed_gaps(summ)
    assert lm_stats.status(g["x"]) == "one seed" and not g["x"]["resolved"]
    assert g["x"]["same_seed_spread_pct"] == 0.0 and g["x"]["deterministic"]
    assert math.isnan(g["x"]["eval_se_pct"])  # no per-sequence losses
    lm_stats.write_gaps(tmp_path, g)
    rows = list(csv.DictReader((tmp_path / "gaps.csv").open()))
    assert list(rows[0]) == list(lm_stats.FIELDS) and rows[1]["status"] == "one seed"
    assert rows[1]["seeds_needed"] == "" and float(rows[1]["target_half_pct"]) == 0.3
    assert (tmp_path / "gaps.json").is_file()


def test_plot_gaps(tmp_path):
    pytest.importorskip("matplotlib")
    summ = {"bf16@s0": _run(1.0), "bf16@s1": _run(1.1), "x@s0": _run(1.02), "x@s1": _run(1.13),
            "y@s0": _run(0.99), "y@s1": _run(1.11), "bf16+repeat1@s0": _run(1.002)}
    path = lm_stats.plot_gaps(tmp_path, lm_stats.seed_gaps(summ), "test")
    assert path == tmp_path / "gaps.png" and path.stat().st_size > 1000


def test_precision_study_jobs_and_flags():
    import precision_study

    jobs = precision_study._jobs(["nvfp4"], [3, 4], repeats=2)
    assert [(t, s) for t, _, _, s in jobs] == [("bf16", 3), ("bf16", 4), ("bf16+repeat1", 3), ("bf16+repeat2", 3),
                                               ("nvfp4", 3), ("nvfp4", 4)]
    assert lm_stats.split_name("bf16+repeat2@s3") == ("bf16+repeat2", 3)
    jobs = precision_study._jobs(["nvfp4+switch0.9"], [0], repeats=1, repeat_configs=("bf16", "nvfp4+switch0.9"))
    assert [(t, r, s) for t, r, _, s in jobs] == [
        ("bf16", "bf16", 0), ("bf16+repeat1", "bf16", 0), ("nvfp4+switch0.9+repeat1", "nvfp4", 0),
        ("nvfp4+switch0.9", "nvfp4", 0)]
    assert jobs[2][2] == precision_study.CONFIGS["nvfp4+switch0.9"][1]  # the configuration's flags
    # the repeat's spread is reported with its configuration ("<configuration>+repeat<k>" against "<configuration>")
    runs = {n: {"val_loss": v, "val_tokens": 1} for n, v in (("bf16@s0", 1.0), ("bf16+repeat1@s0", 1.001),
            ("nvfp4+switch0.9@s0", 1.02), ("nvfp4+switch0.9+repeat1@s0", 1.02 * 1.01))}
    spread = lm_stats.seed_gaps(runs)
    assert spread["nvfp4+switch0.9"]["same_seed_spread_pct"] == pytest.approx(1.0)
    assert spread["bf16"]["same_seed_spread_pct"] == pytest.approx(0.1)


def test_pre_switch_spread():
    """A configuration and its +switch variant of one seed compute the same steps until the switch: their validation
    losses at the last common evaluation before it give the configuration's same-seed spread (max over seeds);
    evaluations at or after the switch step, pairs without curves and unpaired runs are left out."""
    def run(val, curve, switch=None):
        return {**_run(val), "val_curve": curve, **({"switch": f"forward GEMMs -> bf16 from step {switch} of 8"}
                                                      if switch else {})}

    runs = {"bf16@s0": run(1.0, []), "bf16@s1": run(1.0, []),
            "q@s0": run(1.1, [[2, 2.0], [4, 1.5], [6, 1.2], [8, 1.1]]),
            "q+switch0.75@s0": run(1.05, [[2, 2.0], [4, 1.5 * 1.02], [6, 9.9], [8, 1.05]], switch=6),
            "q@s1": run(1.1, [[2, 2.0], [4, 1.5]]),
            "q+switch0.75@s1": run(1.05, [[2, 2.0 * 1.01], [4, 1.5 * 1.005]], switch=6),
            "r@s0": run(1.1, [[2, 2.0]]), "r+switch0.5@s0": run(1.0, [[2, 2.0]], switch=2),  # none before step 2
            "u+switch0.5@s0": run(1.0, [[2, 2.0]], switch=4)}  # no "u" run
    assert lm_stats.pre_switch_spread(runs) == {"q": pytest.approx(2.0)}
    gaps = lm_stats.seed_gaps(runs)
    assert gaps["q"]["pre_switch_spread_pct"] == pytest.approx(2.0) and gaps["r"]["pre_switch_spread_pct"] is None
    assert "pre-switch" in lm_stats.format_gaps(gaps)


@pytest.mark.slow
def test_switch_runs_equal_before_the_switch_on_the_cpu(tmp_path):
    """The premise of pre_switch_spread, on the CPU (deterministic): a run and its +switch variant of one seed log the
    same train and validation losses before the switch step; precision_study attaches the curves and reports 0."""
    pytest.importorskip("flax")
    import precision_study

    argv = ["--preset", "tiny", "--steps", "10", "--seeds", "0", "--configs", "", "--out", str(tmp_path), "--",
            "--layers", "1", "--batch", "4", "--seq", "32", "--eval-every", "2", "--eval-batches", "1",
            "--val-tokens", "0", "--log-every", "1"]
    for config in ("nvfp4-fwd-mxfp8-bwd", "nvfp4-fwd-mxfp8-bwd+switch0.9"):  # the switch at step 9 of 10
        argv[argv.index("--configs") + 1] = config
        assert precision_study.main(argv) == 0
    a, b = (list(csv.DictReader((tmp_path / "runs" / n / "curves.csv").open()))
            for n in ("nvfp4-fwd-mxfp8-bwd@s0", "nvfp4-fwd-mxfp8-bwd+switch0.9@s0"))
    before = [(r["step"], r["train_loss"], r["val_loss"]) for r in a if int(r["step"]) < 9]
    assert len(before) == 8 and before == [(r["step"], r["train_loss"], r["val_loss"]) for r in b if int(r["step"]) < 9]
    assert a[-1]["val_loss"] != b[-1]["val_loss"]  # the switch changes the last step's forward GEMMs
    gaps = json.loads((tmp_path / "gaps.json").read_text())
    assert gaps["nvfp4-fwd-mxfp8-bwd"]["pre_switch_spread_pct"] == 0.0


def test_precision_study_keeps_finished_runs_and_merges_them(tmp_path, monkeypatch):
    """Runs with a summary.json are not queued again; with every run finished the study only merges: gaps.json over
    the union of the runs (two seeds of bf16 and one configuration, as if from two invocations), its plot titled with
    every merged seed even when this invocation names fewer."""
    import precision_study

    titles = []
    monkeypatch.setattr(precision_study.lm_stats, "plot_gaps", lambda out, gaps, title: titles.append(title))
    jobs = precision_study._jobs(["nvfp4"], [0, 1])
    _write_runs(tmp_path, (("bf16@s0", 1.0), ("nvfp4@s0", 1.02), ("bf16@s1", 1.1)))
    todo, finished = precision_study._pending(jobs, tmp_path)
    assert [(t, s) for t, _, _, s in todo] == [("nvfp4", 1)] and finished == ["bf16@s0", "bf16@s1", "nvfp4@s0"]
    _write_runs(tmp_path, [("nvfp4@s1", 1.1 * 1.03)])
    assert precision_study.main(["--seeds", "0", "1", "--configs", "nvfp4", "--out", str(tmp_path)]) == 0
    gaps = json.loads((tmp_path / "gaps.json").read_text())
    assert gaps["nvfp4"]["seeds"] == [0, 1]
    assert gaps["nvfp4"]["gaps_pct"] == pytest.approx([2.0, 3.0])
    assert precision_study.main(["--preset", "tiny", "--seeds", "1", "--configs", "nvfp4", "--out", str(tmp_path)]) == 0
    assert titles[-1] == "--preset tiny, seeds 0 1"


def _no_subprocess(*args, **kwargs):
    raise AssertionError(f"no process may start: {args}")


def test_precision_study_merge_only(tmp_path, monkeypatch, capsys):
    """--merge-only trains nothing: it merges the finished runs under OUT/runs (a run without summary.json is left
    out) into summary.json and the gaps files, the plot titled with the seeds of the run names; with no finished run
    it is a usage error."""
    import precision_study

    monkeypatch.setattr(precision_study.subprocess, "run", _no_subprocess)
    titles = []
    monkeypatch.setattr(precision_study.lm_stats, "plot_gaps", lambda out, gaps, title: titles.append(title))
    runs = {"bf16@s3": 1.0, "nvfp4@s3": 1.02, "bf16@s5": 1.1, "nvfp4@s5": 1.1 * 1.03, "mxfp8@s5": 1.105}
    _write_runs(tmp_path, runs.items())
    (tmp_path / "runs" / "mxfp8@s3").mkdir()  # a failed run: its train.log only
    (tmp_path / "runs" / "mxfp8@s3" / "train.log").write_text("Traceback")
    assert precision_study.main(["--merge-only", "--preset", "tiny", "--out", str(tmp_path),
                                 "--target-half", "0.5"]) == 0
    rows = list(csv.DictReader((tmp_path / "gaps.csv").open()))
    assert [r["configuration"] for r in rows] == ["bf16", "mxfp8", "nvfp4"]
    assert float(rows[2]["target_half_pct"]) == 0.5
    assert int(rows[2]["seeds_needed"]) == lm_stats.seeds_needed(np.std([2.0, 3.0], ddof=1), 0.5)
    assert set(json.loads((tmp_path / "summary.json").read_text())) == set(runs)
    gaps = json.loads((tmp_path / "gaps.json").read_text())
    assert gaps["nvfp4"]["seeds"] == [3, 5] and gaps["nvfp4"]["gaps_pct"] == pytest.approx([2.0, 3.0])
    assert titles == ["--preset tiny, seeds 3 5"]  # the seeds found, not the --seeds default
    assert "nvfp4" in capsys.readouterr().out
    (tmp_path / "empty" / "runs" / "bf16@s0").mkdir(parents=True)  # a run that never finished
    with pytest.raises(SystemExit) as e:
        precision_study.main(["--merge-only", "--out", str(tmp_path / "empty")])
    assert e.value.code == 2 and "no finished run under" in capsys.readouterr().err
    assert not (tmp_path / "empty" / "summary.json").exists()


def test_precision_study_run_dirs_share_one_tokenizer(tmp_path):
    """Each run's tokenizer cache is the relative link runs/<run>/tokenizer -> ../../tokenizer (valid in a copy of
    the study); a finished run and a tokenizer directory of its own are left alone."""
    import precision_study

    run = precision_study._prepare_run_dir(tmp_path, "bf16@s0")
    link = run / "tokenizer"
    assert run == tmp_path / "runs" / "bf16@s0" and link.is_symlink()
    assert os.readlink(link) == os.path.join("..", "..", "tokenizer")
    assert link.resolve() == (tmp_path / "tokenizer").resolve()
    assert precision_study._prepare_run_dir(tmp_path, "bf16@s0") == run and link.is_symlink()  # again: unchanged
    (tmp_path / "tokenizer" / "bpe-300-x.json").write_text("{}")
    assert (link / "bpe-300-x.json").read_text() == "{}"
    copy = shutil.copytree(tmp_path, tmp_path.parent / f"{tmp_path.name}-copy", symlinks=True)
    assert (copy / "runs" / "bf16@s0" / "tokenizer").resolve() == (copy / "tokenizer").resolve()
    own = tmp_path / "runs" / "x@s0" / "tokenizer"
    own.mkdir(parents=True)
    precision_study._prepare_run_dir(tmp_path, "x@s0")
    assert own.is_dir() and not own.is_symlink()
    _write_runs(tmp_path, [("y@s0", 1.0)])
    precision_study._prepare_run_dir(tmp_path, "y@s0")
    assert not (tmp_path / "runs" / "y@s0" / "tokenizer").exists()


def test_precision_study_launches_runs_on_the_shared_tokenizer(tmp_path, monkeypatch):
    """The study launches each unfinished run (train_lm replaced by a stand-in that writes its summary) with
    --out/tokenizer already the link to OUT/tokenizer, then merges."""
    import types

    import precision_study

    launched = []

    def fake_run(cmd, **kwargs):
        if cmd[0] == "nvidia-smi":
            raise OSError("no GPUs here")
        out = Path(cmd[cmd.index("--out") + 1])
        assert (out / "tokenizer").resolve() == (tmp_path / "tokenizer").resolve()
        launched.append(out.name)
        _write_runs(tmp_path, [(out.name, 1.02 if out.name.startswith("nvfp4") else 1.0)])
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(precision_study.subprocess, "run", fake_run)
    _write_runs(tmp_path, [("bf16@s0", 1.0)])  # finished: not launched, not linked
    argv = ["--preset", "tiny", "--seeds", "0", "--configs", "nvfp4", "--out", str(tmp_path)]
    assert precision_study.main(argv) == 0
    assert launched == ["nvfp4@s0"] and not (tmp_path / "runs" / "bf16@s0" / "tokenizer").exists()
    assert json.loads((tmp_path / "gaps.json").read_text())["nvfp4"]["gaps_pct"] == pytest.approx([2.0])


def test_precision_study_start_by(tmp_path, monkeypatch, capsys):
    """--start-by S: no run starts later than S seconds into the study (a fake clock; each run takes 100 s); the runs
    left are listed, the same command trains them, and a negative S is a usage error."""
    import types

    import precision_study

    clock, launched = [1000.0], []

    def fake_run(cmd, **kwargs):
        if cmd[0] == "nvidia-smi":
            raise OSError("no GPUs here")
        out = Path(cmd[cmd.index("--out") + 1])
        launched.append(out.name)
        clock[0] += 100
        _write_runs(tmp_path, [(out.name, 1.0)])
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(precision_study.subprocess, "run", fake_run)
    monkeypatch.setattr(precision_study, "time", types.SimpleNamespace(time=lambda: clock[0], sleep=lambda s: None))
    argv = ["--preset", "tiny", "--seeds", "0", "1", "--configs", "nvfp4", "--out", str(tmp_path)]
    assert precision_study.main([*argv, "--start-by", "150"]) == 0
    assert launched == ["bf16@s0", "bf16@s1"]  # started at 0 s and 100 s; the next would start at 200 s
    assert "not started (--start-by 150 s): nvfp4@s0, nvfp4@s1" in capsys.readouterr().out
    assert precision_study.main(argv) == 0
    assert launched[2:] == ["nvfp4@s0", "nvfp4@s1"]
    with pytest.raises(SystemExit) as e:
        precision_study.main([*argv, "--start-by", "-1"])
    assert e.value.code == 2 and "--start-by -1.0: must be >= 0 seconds" in capsys.readouterr().err


def test_precision_study_gpus_per_run(tmp_path, monkeypatch, capsys):
    """--gpus-per-run N: the GPUs in consecutive groups of N (a remainder unused), each run's CUDA_VISIBLE_DEVICES one
    group and its train_lm command the fsdp mesh 1xNx1 unless a --mesh follows `--`; more GPUs per run than GPUs is
    a usage error."""
    import types

    import precision_study

    assert precision_study._slots([0, 1, 2, 3], 2, 1, None) == [((0, 1), 0.9), ((2, 3), 0.9)]
    assert precision_study._slots([0, 1, 2], 2, 2, None) == [((0, 1), 0.45), ((0, 1), 0.45)]
    assert precision_study._slots([5], 1, 1, 0.5) == [((5,), 0.5)]
    assert precision_study._slots([], 1, 1, None) == [(None, 0.0)]
    launched = {}

    def fake_run(cmd, env=None, **kwargs):
        out = Path(cmd[cmd.index("--out") + 1])
        mesh = tuple(cmd[i + 1] for i, a in enumerate(cmd) if a == "--mesh")
        launched[out.name] = (env["CUDA_VISIBLE_DEVICES"], mesh)
        _write_runs(tmp_path / out.parent.parent.name, [(out.name, 1.0)])
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(precision_study.subprocess, "run", fake_run)
    monkeypatch.setattr(precision_study.time, "sleep", lambda s: None)
    argv = ["--seeds", "0", "1", "--configs", "", "--gpus", "0,1,2,3", "--gpus-per-run", "2"]
    assert precision_study.main(argv + ["--out", str(tmp_path / "a")]) == 0
    assert len(launched) == 2 and set(launched.values()) <= {("0,1", ("1x2x1",)), ("2,3", ("1x2x1",))}
    launched.clear()
    assert precision_study.main(argv + ["--out", str(tmp_path / "b"), "--", "--mesh", "2x1x1"]) == 0
    assert {m for _, m in launched.values()} == {("2x1x1",)}  # the mesh given, not 1x2x1 as well
    with pytest.raises(SystemExit) as e:
        precision_study.main(["--gpus", "0", "--gpus-per-run", "2", "--out", str(tmp_path / "c")])
    assert e.value.code == 2 and "only 1 GPU(s)" in capsys.readouterr().err


def _tiny_corpus():
    import lm_data

    root = Path(__file__).resolve().parents[1] / "examples" / "lm"
    data = np.frombuffer(b"".join(p.read_bytes() for p in sorted(root.glob("lm_*.py"))[:3]), np.uint8)
    cut = data.size * 9 // 10
    return lm_data.Corpus(data[:cut], data[cut:], "test")


def test_tokenize_corpus_cache_is_written_whole(tmp_path):
    """The cache holds exactly the tokenizer and the token ids (no temporary file left), a second call loads them,
    concurrent writers into one cache agree, and a failed write leaves nothing behind."""
    pytest.importorskip("tokenizers")
    import threading

    import lm_tokenizer

    corpus = _tiny_corpus()
    key = lm_tokenizer.cache_key(corpus, 300, lm_tokenizer.TRAIN_BYTES)
    c1 = lm_tokenizer.tokenize_corpus(corpus, 300, tmp_path, log=lambda s: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"bpe-300-{key}.json", f"tokens-{key}.npz"]
    logs = []
    c2 = lm_tokenizer.tokenize_corpus(corpus, 300, tmp_path, log=logs.append)
    assert "(cached)" in logs[0]
    np.testing.assert_array_equal(c1.train, c2.train)
    np.testing.assert_array_equal(c1.val, c2.val)
    assert lm_tokenizer.load(tmp_path / f"bpe-300-{key}.json").get_vocab_size() == 300
    shared, results = tmp_path / "shared", []

    def tokenize():
        results.append(lm_tokenizer.tokenize_corpus(corpus, 300, shared, log=lambda s: None))

    threads = [threading.Thread(target=tokenize) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    assert sorted(p.name for p in shared.iterdir()) == [f"bpe-300-{key}.json", f"tokens-{key}.npz"]
    for c in results:
        np.testing.assert_array_equal(c.train, c1.train)

    def fail(f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        lm_tokenizer._write_atomic(tmp_path / "x.npz", fail)
    assert not any(p.name.startswith(("x.npz", ".x.npz")) for p in tmp_path.iterdir())


def test_val_tokens_and_deterministic_flags():
    pytest.importorskip("flax")
    import lm_config

    args, cfg, _ = lm_config.parse_args(["--preset", "small"])
    assert cfg.final_eval_batches * cfg.batch * cfg.model.seq >= 2**20 and not cfg.deterministic
    assert cfg.model.attention == "auto"
    _, cfg, _ = lm_config.parse_args(["--val-tokens", "1000", "--eval-batches", "1", "--deterministic"])
    assert cfg.final_eval_batches == math.ceil(1000 / (cfg.batch * cfg.model.seq)) and cfg.deterministic
    assert cfg.model.attention == "xla"
    # the attention implementation is how a step runs, not what it trains: checkpoints resume under either
    _, plain, _ = lm_config.parse_args([])
    assert cfg.resume_key()["model"] == plain.resume_key()["model"]
    _, cfg, _ = lm_config.parse_args(["--eval-batches", "5", "--val-tokens", "0"])
    assert cfg.final_eval_batches == 5


def test_attention_flag(capsys):
    """--attention picks the attention of the step (the default: cuDNN's on GPUs, XLA's with --deterministic);
    --deterministic --attention cudnn is refused for a quantized recipe on a mesh of several devices, where XLA
    aborts compiling it, and kept for bf16 there and for every recipe on one device."""
    pytest.importorskip("flax")
    import lm_config
    import lm_layers

    for argv, want in (([], "auto"), (["--deterministic"], "xla"), (["--attention", "xla"], "xla"),
                       (["--deterministic", "--attention", "cudnn", "--recipe", "nvfp4"], "cudnn")):
        model = lm_config.parse_args(argv)[1].model
        assert model.attention == want, argv
        # distinct attention windows only where cuDNN's attention runs under deterministic ops
        assert model.distinct_attention == (want == "cudnn"), argv
    assert not lm_config.parse_args(["--attention", "cudnn"])[1].model.distinct_attention
    assert lm_layers.attention_implementation("cudnn") == (None if jax.default_backend() == "cpu" else "cudnn")
    with pytest.raises(ValueError, match="attention must be one of"):
        lm_layers.attention_implementation("flash")
    mesh = ["--deterministic", "--attention", "cudnn", "--mesh", "1x1x1"]
    assert lm_config.parse_args(mesh + ["--recipes", "bf16,nvfp4"])[1].model.attention == "cudnn"  # one device
    problem = lm_config.attention_problem
    assert problem(True, "cudnn", (1, 2, 1, 1), ["bf16"]) is None
    assert problem(True, "xla", (1, 2, 1, 1), ["nvfp4"]) is None
    assert problem(False, "cudnn", (2, 1, 1, 1), ["nvfp4"]) is None
    assert problem(True, "cudnn", None, ["nvfp4"]) is None and problem(True, "cudnn", (1, 1, 1, 1), ["nvfp4"]) is None
    msg = problem(True, "cudnn", (1, 2, 1, 1), ["bf16", "nvfp4-fwd-mxfp8-bwd"])
    assert "XLA aborts compiling the quantized step (nvfp4-fwd-mxfp8-bwd)" in msg and "1x2x1x1" in msg


def test_gap_scaling(tmp_path, capsys):
    import gap_scaling

    for name, params, gap in (("s", 7_000_000, 0.02), ("m", 85_000_000, 0.01)):
        d = tmp_path / name
        d.mkdir()
        summ = {}
        for seed, base in enumerate((1.0, 1.1, 1.05)):
            det = name == "m"
            summ[f"bf16@s{seed}"] = dict(_run(base, det=det), params=params,
                                         **({"steps": 100, "tokens_per_step": 1_400_000} if det else {}))
            summ[f"x@s{seed}"] = dict(_run(base * (1 + gap + 0.001 * seed), det=det), params=params)
        (d / "summary.json").write_text(json.dumps(summ))
    rows = gap_scaling.main([str(tmp_path / "s"), str(tmp_path / "m"), "--out", str(tmp_path / "o")])
    assert [(r["params"], r["status"], r["deterministic"]) for r in rows] == [
        (7_000_000, "resolved", False), (85_000_000, "resolved", True)]
    assert rows[0]["mean_pct"] == pytest.approx(2.1) and rows[1]["mean_pct"] == pytest.approx(1.1)
    assert math.isnan(rows[0]["tokens_per_param"]) and rows[1]["tokens_per_param"] == pytest.approx(100 * 1.4e6 / 85e6)
    assert (tmp_path / "o" / "gap_scaling.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "x " in out and out.count("(not deterministic)") == 2  # the small size's row and its change to 85M
    assert "7.0M -> 85.0M  -1.00" in out
    changes = list(csv.DictReader((tmp_path / "o" / "size_changes.csv").open()))
    assert [(c["configuration"], c["status"]) for c in changes] == [("x", "resolved")]
    assert "gaps_pct" not in next(csv.DictReader((tmp_path / "o" / "gap_scaling.csv").open()))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "summary.json").write_text(json.dumps({"bf16@s0": _run(1.0)}))
    with pytest.raises(ValueError, match="disagree on \\(or lack\\) the parameter count"):
        gap_scaling.collect([bad])


def test_gap_scaling_line_breaks_at_an_unmeasured_size():
    import gap_scaling

    rows = [{"configuration": c, "params": n, "mean_pct": g}
            for c, n, g in (("a", 7, 2.0), ("a", 85, 1.5), ("a", 340, 1.0), ("b", 7, 1.2), ("b", 340, 1.3))]
    assert gap_scaling.line(rows, "a") == ([7, 85, 340], [2.0, 1.5, 1.0])
    sizes, means = gap_scaling.line(rows, "b")
    assert sizes == [7, 85, 340] and means[0] == 1.2 and math.isnan(means[1]) and means[2] == 1.3


def test_gap_scaling_size_changes():
    """The change of each configuration's gap between consecutive measured sizes, with the Welch interval of the
    two sizes' per-seed gaps: resolved only when it excludes 0."""
    import gap_scaling

    rows = [{"configuration": c, "params": n, "gaps_pct": g, "deterministic": det}
            for c, n, g, det in (("a", 7, [2.0, 2.1, 2.2], True), ("a", 85, [1.0, 1.1, 1.2], True),
                                 ("a", 340, [0.0, 1.0, 2.0], False), ("b", 7, [1.0, 1.2, 1.4], True),
                                 ("b", 340, [1.1, 1.3, 1.5], False))]
    changes = gap_scaling.size_changes(rows)
    assert [(c["configuration"], c["from_params"], c["to_params"], c["status"], c["deterministic"])
            for c in changes] == [("a", 7, 85, "resolved", True), ("a", 85, 340, "unresolved", False),
                                  ("b", 7, 340, "unresolved", False)]
    assert changes[0]["change_pct"] == pytest.approx(-1.0)
    assert (changes[0]["ci_low_pct"], changes[0]["ci_high_pct"]) == pytest.approx(
        lm_stats.welch_interval([2.0, 2.1, 2.2], [1.0, 1.1, 1.2])[1:])
