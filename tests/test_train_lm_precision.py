"""Precision control in examples/lm/train_lm.py (policy flags, precision switch, diagnostics, seeds, medium preset) and
jax_fp4.schedule.PrecisionSwitch, on the CPU.

* PrecisionSwitch: the switch step of a step / fraction, the phases, the switched recipes (forward only or all GEMMs,
  unquantized layers kept), bad arguments;
* a model built with two phases: one compiled step per phase over the same state (each compiled once: at most one
  recompilation at the switch);
* a run that switches mid-way equals a run stopped at the switch and resumed across it (states bit for bit, the
  curves, the diagnostics rows); the checkpoint records the phase and the layer recipes; diagnostics.csv holds 6
  operands per Dense layer and per diagnostics step, and the heatmaps are written (the statistics themselves are
  tests/test_diagnostics.py's);
* the policy flags: layer tables, run names, per-block rules on scanned blocks (segments), bad flags and a rule
  matching nothing exit with a message;
* seed-averaged gaps against the bf16 run of the same seed; the MFU peak table;
* the medium preset: 85-125M parameters, its shapes validated by abstract evaluation (jax.eval_shape, no FLOPs).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")
pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "lm"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import lm_checkpoint  # noqa: E402
import lm_data  # noqa: E402
import lm_layers  # noqa: E402
import lm_model  # noqa: E402
import lm_precision  # noqa: E402
import lm_stats  # noqa: E402
import train_lm  # noqa: E402
from flax import nnx  # noqa: E402

from jax_fp4 import MXFP8 as MXFP8Format  # noqa: E402
from jax_fp4 import policy as P  # noqa: E402
from jax_fp4 import recipes  # noqa: E402
from jax_fp4.flax import policy as FP  # noqa: E402
from jax_fp4.schedule import PrecisionSwitch  # noqa: E402

pytestmark = pytest.mark.slow  # example harness end to end (switch, policies): full suite only

FAST = ["--preset", "tiny", "--layers", "1", "--batch", "4", "--seq", "32", "--lr", "1e-2", "--warmup", "2",
        "--log-every", "1", "--eval-every", "1000", "--eval-batches", "1", "--no-progress"]
NV = recipes.NVFP4Fwd_MXFP8Bwd()


def test_precision_switch():
    s = PrecisionSwitch(0.9, recipes.BF16())
    assert s.switch_step(2000) == 1800 and s.phase(1799, 2000) == 0 and s.phase(1800, 2000) == 1
    assert PrecisionSwitch(5, recipes.MXFP8()).switch_step(2000) == 5
    fwd = s.recipe(NV)
    assert fwd.fprop_x is None and fwd.fprop_w is None and fwd.formats()[2:] == NV.formats()[2:]
    assert fwd.name == "nvfp4-fwd-mxfp8-bwd+fwd-bf16"
    assert PrecisionSwitch(0.5, recipes.MXFP8(), "all").recipe(NV) == recipes.MXFP8()
    assert s.recipe(recipes.BF16()) == recipes.BF16()  # a layer kept in bf16 stays so
    before, after = s.phases(P.last_blocks(1, num_blocks=4) + P.uniform(NV))
    assert after.default == fwd and after.rules[0].recipe == recipes.BF16() and before.default == NV
    for bad in (1.5, -1, 0.0, True, "0.5"):
        with pytest.raises(ValueError):
            PrecisionSwitch(bad, recipes.BF16())
    with pytest.raises(ValueError, match="scope must be one of"):
        PrecisionSwitch(0.5, recipes.BF16(), "bwd")
    with pytest.raises(ValueError, match="needs a default recipe"):
        s.phases(P.last_blocks(1, num_blocks=4))


def test_phases_compile_once():
    """Two phases of a model whose recipe quantizes only dgrad (a cheap compile), switched to bf16: each phase's
    step compiles once, over one state; the second phase's layers run unquantized."""
    dg = recipes.Recipe("mx-dgrad", dgrad_dy=MXFP8Format(), dgrad_w=MXFP8Format())
    cfg = lm_model.ModelConfig(d_model=64, n_layers=1, n_heads=2, seq=32)
    sw = PrecisionSwitch(2, recipes.BF16(), "all")
    ph = lm_model.build_phases(cfg, dg, sw.phases(P.uniform(dg)), lm_model.OptConfig(steps=4), seed=0)
    assert ph.graphdefs[0] != ph.graphdefs[1] and "mx-dgrad" in ph.tables[0] and "mx-dgrad" not in ph.tables[1]
    corpus = lm_data.Corpus(np.arange(4096, dtype=np.uint8), np.zeros(64, np.uint8), "")
    state, losses = ph.state, []
    for step in range(4):
        state, out = ph.steps[sw.phase(step, 4)](state, lm_data.train_batch(corpus, step, 4, 32, 0))
        losses.append(float(out["loss"]))
    assert all(map(math.isfinite, losses))
    assert ph.steps[0]._cache_size() == 1 and ph.steps[1]._cache_size() == 1


def _rows(path):
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_switch_resume_equals_uninterrupted(tmp_path, capsys):
    """mxfp8 for 2 steps, then bf16 (all GEMMs) for 6, diagnostics every 3 steps (both after the switch: the
    quantized diagnostics step's compile is left to test_diagnostics.py)."""
    flags = [*FAST, "--recipe", "mxfp8", "--steps", "8", "--switch-at", "2", "--switch-to", "bf16",
             "--switch-scope", "all", "--diagnostics", "3"]
    a, b = tmp_path / "a", tmp_path / "b"
    sa = train_lm.main([*flags, "--out", str(a)])
    train_lm.main([*flags, "--out", str(b), "--stop-at", "2"])
    sb = train_lm.main([*flags, "--out", str(b), "--resume"])
    out = capsys.readouterr().out
    name = "mxfp8+switch2-bf16-all"
    assert set(sa) == set(sb) == {name} and f"{name}: resumed from" in out and "at step 2 (phase 1)" in out
    assert "layer recipes after the switch (all GEMMs -> bf16 from step 2 of 8)" in out

    cfg = lm_model.ModelConfig(d_model=64, n_layers=1, n_heads=2, seq=32)
    states = []
    for d in (a, b):
        mgr = lm_checkpoint.checkpointer(d / "checkpoints" / name)
        assert mgr.latest_step() == 8
        _, template, _ = lm_model.build(cfg, recipes.MXFP8(), lm_model.OptConfig(), seed=0)
        st, meta = lm_checkpoint.restore_checkpoint(mgr, 8, template)
        states.append(jax.tree.map(np.asarray, nnx.to_pure_dict(st)))
        assert meta["switch"] == "all GEMMs -> bf16 from step 2 of 8" and meta["phase"] == 1
        assert "bf16" in meta["phase_recipes"] and "mxfp8" not in meta["phase_recipes"]
    for u, v in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1]), strict=True):
        np.testing.assert_array_equal(u, v)
    ra, rb = _rows(a / "curves.csv"), _rows(b / "curves.csv")
    for key in ("step", "recipe", "train_loss", "val_loss", "phase"):
        assert [r[key] for r in ra] == [r[key] for r in rb]
    assert [r["phase"] for r in ra] == ["0"] * 2 + ["1"] * 6
    da, db = _rows(a / "diagnostics.csv"), _rows(b / "diagnostics.csv")
    assert len(da) == 2 * 4 * 6 and {r["step"] for r in da} == {"3", "6"}  # 2 steps x 4 Dense layers x 6 operands
    for key in ("step", "layer", "operand", "snr_db", "saturated", "flushed", "amax"):
        assert [r[key] for r in da] == [r[key] for r in db]
    assert all(math.isinf(float(r["snr_db"])) and float(r["amax"]) > 0 for r in da)  # bf16: nothing quantized
    assert (a / "diagnostics.png").stat().st_size > 1000 and (a / f"diagnostics_{name}_saturated.png").is_file()
    assert sa[name]["diag_step_ms"] > 0 and sa[name]["mfu"] is None  # a CPU has no entry in the peak table


def test_policy_flags(capsys):
    args, cfg, names = train_lm.parse_args(["--layers", "3", "--bf16-last", "1", "--exclude", "*/out",
                                            "--policy-mlp-only", "--preset", "small"])
    assert cfg.model.scan_layers  # the small preset scans; per-block rules split the stack into segments
    assert lm_precision.run_name("nvfp4", args) == "nvfp4+excl-_out+bf16-last1+mlp-only"
    assert lm_precision.run_name("bf16", args) == "bf16" and lm_precision.run_name("bf16", args, 2) == "bf16@s2"
    pol = lm_precision.make_policy(args, NV, 3)
    assert [r.pattern for r in pol.rules] == ["*/out", "blocks/2", "*/mlp", "*"] and pol.default == NV
    model = lm_model.make_model(dataclasses.replace(cfg.model, scan_layers=False), NV, 0)
    table = {ln.split()[0]: ln.split()[1] for ln in FP.describe(pol, model).splitlines()[2:]}
    assert table["blocks/0/mlp/up"] == NV.name and table["blocks/2/mlp/up"] == "bf16"
    assert table["blocks/0/qkv/dense"] == "bf16" and table["blocks/1/out"] == "bf16"
    args, _, names = train_lm.parse_args(["--recipes", "bf16,mxfp8", "--seeds", "0", "1", "--switch-at", "300"])
    assert names == ["bf16", "mxfp8"] and lm_precision.make_switch(args) == PrecisionSwitch(300, recipes.BF16())


@pytest.mark.parametrize("argv,message", [
    (["--bf16-last", "3"], "--bf16-last 3 exceeds the 2 blocks"),
    (["--switch-to", "mxfp8"], "--switch-to / --switch-scope need --switch-at"),
    (["--switch-at", "1.5"], "--switch-at: must be a fraction of training in (0, 1) or a step >= 1"),
    (["--bf16-last-fraction", "2"], "--bf16-last-fraction: must be a fraction in [0, 1]"),
    (["--exclude", "re:("], "--exclude: Rule: bad regular expression"),
    (["--stop-at", "100"], "--stop-at 100 is beyond --steps 80"),
    (["--recipes", "bf16,fp2"], "unknown recipe(s) ['fp2']"),
    (["--seeds", "1", "1"], "--seeds [1, 1]: repeated seeds"),
])
def test_bad_precision_flags(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        train_lm.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_unmatched_rule_exits(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_lm.main([*FAST, "--recipe", "mxfp8", "--steps", "1", "--exclude", "blocks/7", "--out", str(tmp_path)])
    assert "rule 'blocks/7' matches no layer of the model" in capsys.readouterr().err


def test_seed_gaps_and_peak():
    summ = {"bf16@s0": {"val_loss": 1.0}, "bf16@s1": {"val_loss": 2.0}, "x@s0": {"val_loss": 1.01},
            "x@s1": {"val_loss": 2.06}, "x@s2": {"val_loss": 9.0}, "y": {"val_loss": 5.0}}
    g = lm_stats.seed_gaps(summ)
    assert set(g) == {"bf16", "x"} and g["x"]["seeds"] == [0, 1]  # seed 2 has no bf16 run: left out
    assert g["x"]["mean_pct"] == pytest.approx(2.0) and g["x"]["std_pct"] == pytest.approx(np.std([1, 3], ddof=1))
    assert g["bf16"]["mean_pct"] == 0 and "x " in lm_stats.format_gaps(g)
    assert lm_precision.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert lm_precision.peak_flops("NVIDIA H100 PCIe") == 756e12 and lm_precision.peak_flops("NVIDIA H200") == 989e12
    assert lm_precision.peak_flops("cpu") is None


def test_medium_preset_shapes():
    args, cfg, _ = train_lm.parse_args(["--preset", "medium"])
    m = cfg.model
    assert (m.d_model, m.n_layers, m.seq, m.scan_layers, args.corpus) == (768, 12, 512, False, "site-packages")
    n = lm_model.count_params(m)
    assert 85e6 <= n <= 125e6, n
    assert lm_model.flops_per_token(m) == pytest.approx(6 * (n - 256 * 768) + 12 * 12 * 768 * 512, rel=1e-3)
    model = nnx.eval_shape(lambda: lm_model.make_model(m, NV, 0))
    batch = jax.ShapeDtypeStruct((cfg.batch, m.seq + 1), jnp.uint8)
    loss = jax.eval_shape(lambda mdl, b: lm_model.loss_fn(mdl, b), model, batch)
    assert loss.shape == () and loss.dtype == jnp.float32
    assert lm_layers.attention_implementation() is None  # the CPU: XLA's attention; "cudnn" on a GPU backend


def test_embedding_is_the_one_hot_product():
    """The model embeds tokens as one_hot @ embedding (a GEMM gradient, no scatter-add): the same values as
    nnx.Embed, and the lookup's gradient up to one bfloat16 rounding of each float32 sum."""
    m = lm_model.make_model(lm_model.ModelConfig(d_model=64, n_layers=1, n_heads=2, seq=16), NV, 0)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, (4, 16)))
    assert bool(jnp.array_equal(m.embed_tokens(tokens), m.embed(tokens)))
    dx = jnp.asarray(np.random.default_rng(4).standard_normal((4, 16, 64)), jnp.float32)
    table = m.embed.embedding[...]

    def via(f):
        return jax.grad(lambda t: jnp.sum(f(t).astype(jnp.float32) * dx))(table)

    onehot = via(lambda t: jax.nn.one_hot(tokens, 256, dtype=jnp.bfloat16) @ t.astype(jnp.bfloat16))
    take = via(lambda t: jnp.take(t, tokens, axis=0).astype(jnp.bfloat16))
    # The GEMM sums the bf16 cotangents in float32 and rounds the sum once to bfloat16 (half an ulp: 2^-8 relative);
    # the float32 sums of the two orders differ by far less.
    np.testing.assert_allclose(np.asarray(onehot), np.asarray(take), rtol=2.0**-8, atol=1e-6)
