"""examples/lm/train_lm.py (the byte-level GPT trained through jax_fp4.flax layers) on the CPU.

* every recipe: a short run on the stdlib corpus in which the training loss falls (1 block, 20 steps; the XLA compile
  of the bit-exact reference kernels dominates: ~2 s for bf16 up to ~30 s for nvfp4 / nvfp4-1x64);
* every recipe starts from the same parameters for the same seed (what --compare relies on);
* checkpoints: a state with stochastic-rounding rng streams survives save / restore bit for bit; a run stopped
  after 3 steps and resumed to 6 ends in the same state and curve as a run of 6 steps; the output files;
* bad flags (also --mesh shapes the model, the batch or the devices do not allow) exit through argparse with a
  message naming the problem;
* the data splits: by file for the stdlib (deterministic, disjoint), by contiguous region for --data; batches are a
  pure function of (seed, step).
* --moe (MoEMLP blocks): the loss falls for bf16 and mxfp8 (~15 s and ~40 s; nvfp4 / nvfp4-1x64 compile slower, each
  was checked by hand), the load-balancing loss is logged; scanned == unrolled MoE blocks; a state with the experts'
  rng streams survives save / restore; a --moe run resumes, and resuming it without --moe exits with the
  difference; bad --moe flags (also --moe with tensor parallelism) exit with a message.
The BF16 recipe's `jax_fp4.flax.nnx.Dense` == `flax.nnx.Linear` bit for bit is tests/test_flax.py's
test_nnx_bf16_dense_is_linear.
"""

from __future__ import annotations

import csv
import json
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
import lm_checkpoint  # noqa: E402
import lm_data  # noqa: E402
import lm_mesh  # noqa: E402
import lm_model  # noqa: E402
import train_lm  # noqa: E402
from flax import nnx  # noqa: E402

from jax_fp4 import NVFP4 as NVFP4Format  # noqa: E402
from jax_fp4 import recipes  # noqa: E402

pytestmark = pytest.mark.slow  # example harness end to end (trains, resumes): full suite only

# 1 block of d_model 64, 4 x 32 = 128 tokens per step: the smallest model the quantized GEMMs' blocks allow.
FAST = ["--preset", "tiny", "--layers", "1", "--batch", "4", "--seq", "32", "--lr", "1e-2", "--warmup", "2",
        "--log-every", "1", "--eval-every", "1000", "--eval-batches", "1", "--no-progress"]


def _rows(out: Path):
    with (out / "curves.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def _bits_equal_trees(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for u, v in zip(la, lb, strict=True):
        u, v = np.atleast_1d(np.asarray(u)), np.atleast_1d(np.asarray(v))
        assert u.dtype == v.dtype and u.shape == v.shape and np.array_equal(u.view(np.uint8), v.view(np.uint8))


@pytest.mark.parametrize("recipe", sorted(recipes.RECIPES))
def test_loss_falls(tmp_path, recipe):
    summary = train_lm.main([*FAST, "--recipe", recipe, "--steps", "20", "--out", str(tmp_path)])[recipe]
    losses = [float(r["train_loss"]) for r in _rows(tmp_path)]
    assert len(losses) == 20 and np.all(np.isfinite(losses)), losses
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    assert last < first - 0.5, (first, last, losses)  # ~5.5 (uniform over 256 bytes) -> ~3.5 nats
    assert np.isfinite(summary["val_loss"]) and summary["val_loss"] < first
    assert summary["bits_per_byte"] == pytest.approx(summary["val_loss"] / np.log(2))


def test_recipes_start_from_the_same_parameters():
    cfg = lm_model.ModelConfig(d_model=64, n_layers=2, n_heads=2, seq=32)
    params = [nnx.state(lm_model.make_model(cfg, recipes.by_name(n), seed=3), nnx.Param) for n in recipes.RECIPES]
    for p in params[1:]:
        _bits_equal_trees(p, params[0])


def test_scan_layers():
    """--scan (the small preset's default): stacked blocks start from the unrolled blocks' weights and under
    nnx.scan compute what the unrolled blocks compute, and each layer keeps its own stochastic-rounding stream,
    advanced once per step."""
    cfg = lm_model.ModelConfig(d_model=64, n_layers=2, n_heads=2, seq=32)
    scfg = lm_model.ModelConfig(d_model=64, n_layers=2, n_heads=2, seq=32, scan_layers=True)
    unrolled, scanned = lm_model.make_model(cfg, recipes.BF16(), 0), lm_model.make_model(scfg, recipes.BF16(), 0)
    p = nnx.to_pure_dict(nnx.state(unrolled, nnx.Param))
    p["blocks"] = jax.tree.map(lambda *layers: np.stack(layers), *(p["blocks"][i] for i in range(cfg.n_layers)))
    p["stacks"] = {0: p.pop("blocks")}
    _bits_equal_trees(nnx.to_pure_dict(nnx.state(scanned, nnx.Param)), p)  # the same initial weights
    batch = lm_data.train_batch(lm_data.Corpus(np.arange(4096, dtype=np.uint8), np.zeros(64, np.uint8), ""), 0, 4,
                                32, seed=0)
    loss = nnx.jit(lm_model.loss_fn)
    np.testing.assert_allclose(loss(scanned, batch), loss(unrolled, batch), rtol=2e-3)

    # A recipe with stochastic rounding (of dy in dgrad only: a cheap compile) keeps one stream per layer, stacked
    # [n_layers]; each scanned layer draws from its own, once per call.
    sr = recipes.Recipe("sr-dgrad", dgrad_dy=NVFP4Format(stochastic_rounding=True), dgrad_w=NVFP4Format())
    model = lm_model.make_model(scfg, sr, 0)
    for _ in range(2):
        assert np.isfinite(float(loss(model, batch)))
    streams = nnx.to_pure_dict(nnx.state(model, nnx.RngState))["stacks"][0]["out"]["rngs"]
    np.testing.assert_array_equal(streams["count"], [2, 2])
    k = jax.random.key_data(streams["key"])
    assert k.shape == (2, 2) and not np.array_equal(k[0], k[1])


@pytest.mark.parametrize("cfg_kw,streams", [
    (dict(d_model=64, n_heads=2, seq=32), 4),  # qkv, out, up, down
    ("moe", 3),  # qkv, out, the MoEMLP's one stream
], ids=["dense", "moe"])
def test_checkpoint_roundtrip_with_rng_streams(tmp_path, cfg_kw, streams):
    """nvfp4 keeps a stochastic-rounding rng stream (typed key + counter) per layer (MoE blocks: in the MoEMLP too);
    all of it is saved and restored."""
    cfg = lm_model.ModelConfig(n_layers=1, **(MOE_CFG if cfg_kw == "moe" else cfg_kw))
    _, state, _ = lm_model.build(cfg, recipes.NVFP4(), lm_model.OptConfig(), seed=1)
    # advance the rng counters so that restoring them is visible
    state = jax.tree.map(lambda x: x + 5 if x.dtype == np.uint32 and x.ndim == 0 else x, state)
    mgr = lm_checkpoint.checkpointer(tmp_path / "ck")
    lm_checkpoint.save_checkpoint(mgr, 7, state, {"step": 7, "rows": []})
    mgr.wait_until_finished()
    _, fresh, _ = lm_model.build(cfg, recipes.NVFP4(), lm_model.OptConfig(), seed=2)
    restored, meta = lm_checkpoint.restore_checkpoint(mgr, mgr.latest_step(), fresh)
    assert meta == {"step": 7, "rows": []}
    assert sum(map(lm_checkpoint.is_key, jax.tree.leaves(restored))) == streams  # typed keys again
    raw = lambda tree: jax.tree.map(lambda x: jax.random.key_data(x) if lm_checkpoint.is_key(x) else x, tree)  # noqa: E731
    _bits_equal_trees(raw(restored), raw(state))


def test_resume_equals_uninterrupted(tmp_path, capsys):
    flags = [*FAST, "--recipe", "bf16", "--eval-every", "3"]
    a, b = tmp_path / "a", tmp_path / "b"
    train_lm.main([*flags, "--steps", "6", "--out", str(a)])
    train_lm.main([*flags, "--steps", "3", "--out", str(b)])
    summary = train_lm.main([*flags, "--steps", "6", "--out", str(b), "--resume"])["bf16"]
    out = capsys.readouterr().out
    assert "resumed from" in out and "vs bf16" in out and "bits/byte" in out

    cfg = lm_model.ModelConfig(d_model=64, n_layers=1, n_heads=2, seq=32)
    states = []
    for d in (a, b):
        mgr = lm_checkpoint.checkpointer(d / "checkpoints" / "bf16")
        assert mgr.latest_step() == 6
        _, template, _ = lm_model.build(cfg, recipes.BF16(), lm_model.OptConfig(), seed=0)
        states.append(lm_checkpoint.restore_checkpoint(mgr, 6, template)[0])
    _bits_equal_trees(*states)

    ra, rb = _rows(a), _rows(b)
    assert [r["step"] for r in rb] == [str(s) for s in range(1, 7)]
    for key in ("step", "recipe", "train_loss", "val_loss"):
        assert [r[key] for r in ra] == [r[key] for r in rb]
    assert [bool(r["val_loss"]) for r in rb] == [False, False, True, False, False, True]
    assert summary["val_loss"] == pytest.approx(float(rb[-1]["val_loss"]))
    assert set(json.loads((b / "summary.json").read_text())) == {"bf16"}
    assert (b / "curves.png").stat().st_size > 0


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "--steps: must be an integer >= 1"),
    (["--steps", "ten"], "--steps: 'ten' is not an integer"),
    (["--recipe", "fp2"], "--recipe: unknown recipe(s) ['fp2']"),
    (["--recipe", "bf16", "--compare"], "not allowed with argument"),
    (["--data", "/nonexistent/corpus.txt"], "--data: no such file"),
    (["--batch", "3", "--seq", "32"], "must be a multiple of 128"),
    (["--d-model", "96"], "d_model 96 must be a multiple of 64"),
    (["--lr", "-1"], "--lr: must be a positive number"),
    (["--preset", "huge"], "--preset: invalid choice"),
    (["--mesh", "2by2"], "--mesh: '2by2' is not DATAxTENSOR or DATAxFSDPxTENSOR"),
    (["--mesh", "0x2"], "with positive sizes"),
    (["--mesh", "1x2x3x4x5"], "with positive sizes"),
    (["--mesh", "3x1"], "--mesh 3x1x1: --batch 8 does not split over the data x fsdp axes (3 x 1)"),
    (["--mesh", "1x3x1"], "--mesh 1x3x1: --batch 8 does not split over the data x fsdp axes (1 x 3)"),
    (["--mesh", "2x1", "--batch", "2"], "64 tokens per batch shard: must be a multiple of 128"),
    (["--mesh", "1x4"], "the 2 attention heads (2 key / value heads; d_model 64 / head size 32) do not split over the "
                        "tensor axis (4)"),
    (["--mesh", "1x4x1", "--batch", "16"], "d_model 64 does not split over the fsdp axis (4) into multiples of 32"),
    (["--mesh", "2x2"], "--mesh 2x1x2 needs data x fsdp x tensor = 4 devices; there are 1"),  # one CPU here
    (["--fsdp-reduce", "output"], "--fsdp-reduce needs a --mesh DATAxFSDPxTENSOR with fsdp > 1"),
    (["--mesh", "2x1x1", "--fsdp-reduce", "float32"], "--fsdp-reduce needs a --mesh DATAxFSDPxTENSOR with fsdp > 1"),
    (["--mesh", "1x2x1", "--fsdp-reduce", "bf16"], "--fsdp-reduce: invalid choice: 'bf16'"),
    (["--vocab", "1000"], "--vocab needs --tokenizer bpe"),
    (["--arch", "llama", "--kv-heads", "3"], "kv_heads 3 must divide n_heads 2"),
    (["--arch", "llama", "--mlp-hidden", "192"], "the MLP width 192 must be a multiple of 64 (llama: 128"),
    (["--moe", "1"], "--moe: must be an integer >= 2, got 1"),
    (["--moe", "four"], "--moe: 'four' is not an integer"),
    (["--top-k", "2"], "--top-k needs --moe"),
    (["--aux-weight", "0.1"], "--aux-weight needs --moe"),
    (["--moe", "--aux-weight", "-1"], "--aux-weight: must be a number >= 0, got -1"),
    (["--moe", "4", "--top-k", "5"], "--top-k 5 exceeds the 4 experts of --moe"),
    (["--moe", "--top-k", "0"], "--top-k: must be an integer >= 1, got 0"),
    (["--moe", "--mesh", "1x2"], "--mesh 1x1x2: --moe has no tensor parallelism (tensor 1): split the experts "
                                 "over the expert axis instead, e.g. --mesh 1x1x1x2"),
])
def test_bad_flags(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        train_lm.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_mesh_flag():
    """--mesh parses DATAxTENSOR (fsdp 1) and DATAxFSDPxTENSOR (expert 1); 1x1 fits the test process's one device.
    Sharded training: test_sharding_train.py and test_train_lm_scale.py."""
    _, cfg, _ = train_lm.parse_args(["--mesh", "1x1"])
    assert cfg.mesh == (1, 1, 1, 1) and train_lm.parse_args([])[1].mesh is None  # (data, fsdp, tensor, expert)
    assert train_lm.parse_args(["--mesh", "1x1x1"])[1].mesh == (1, 1, 1, 1)
    assert "mesh" not in cfg.resume_key()  # checkpoints hold global arrays: a run may resume on another mesh
    model = lm_model.ModelConfig(d_model=64, n_layers=1, n_heads=2, seq=64)
    assert lm_mesh.mesh_problems(model, 8, 2, 1, 2) == [] and lm_mesh.mesh_problems(model, 8, 1, 2, 1) == []
    assert lm_mesh.mesh_notes(model, recipes.NVFP4_1x64(), 2) and not lm_mesh.mesh_notes(model, recipes.MXFP8(), 2)
    assert cfg.fsdp_reduce == "float32" and "fsdp_reduce" not in cfg.resume_key()


def test_fsdp_layer_recipe():
    """On a mesh with fsdp > 1 a quantized recipe becomes jax_fp4.distributed.shard_recipe(recipe, fsdp_axes="fsdp",
    reduce_dtype=...) with the same operand formats; bf16, None, one device and fsdp 1 keep the recipe."""
    from jax_fp4.distributed import ShardedRecipe

    fsdp, dp = (jax.sharding.AbstractMesh(s, lm_mesh.AXES) for s in ((1, 2, 1, 1), (2, 1, 2, 1)))
    for r in (recipes.NVFP4(), recipes.MXFP8(), recipes.NVFP4Fwd_MXFP8Bwd()):
        for red in ("float32", "output"):
            s = lm_mesh.layer_recipe(r, fsdp, red)
            assert isinstance(s, ShardedRecipe) and (s.fsdp_axes, s.reduce_dtype) == (("fsdp",), red)
            assert s.formats() == r.formats() and s.name == r.name
        assert lm_mesh.layer_recipe(r, dp) is r and lm_mesh.layer_recipe(r, None) is r
    assert lm_mesh.layer_recipe(recipes.BF16(), fsdp) == recipes.BF16() and lm_mesh.layer_recipe(None, fsdp) is None
    with pytest.raises(ValueError, match="reduce_dtype must be one of"):
        lm_mesh.layer_recipe(recipes.MXFP8(), fsdp, "bfloat16")


def test_resume_without_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_lm.parse_args(["--resume", "--out", str(tmp_path)])
    assert "--resume: no checkpoint" in capsys.readouterr().err


def test_data_file_too_small(tmp_path, capsys):
    f = tmp_path / "short.txt"
    f.write_text("hello world\n" * 10)
    with pytest.raises(SystemExit):
        train_lm.main(["--data", str(f), "--out", str(tmp_path / "out")])
    assert "fewer than one window" in capsys.readouterr().err


def test_data_splits(tmp_path):
    files = lm_data.stdlib_files()
    assert files == lm_data.stdlib_files() and len(set(files)) == len(files) > 100
    assert not any(part in ("site-packages", "dist-packages") for f in files for part in f.parts)
    val = [f for f in files if lm_data.is_validation_file(f)]
    assert 0.05 < len(val) / len(files) < 0.15
    assert not lm_data.is_validation_file(Path("os.py")) and lm_data.is_validation_file(Path("random.py"))

    f = tmp_path / "text.txt"
    f.write_bytes(bytes(range(256)) * 40)
    c = lm_data.load_text_file(f)
    assert c.train.size + c.val.size == 10240 and c.val.size == 1024
    np.testing.assert_array_equal(np.concatenate([c.train, c.val]), np.frombuffer(f.read_bytes(), np.uint8))

    b1, b2 = lm_data.train_batch(c, 5, 4, 32, seed=0), lm_data.train_batch(c, 5, 4, 32, seed=0)
    assert b1.shape == (4, 33) and b1.dtype == np.uint8
    np.testing.assert_array_equal(b1, b2)
    assert not np.array_equal(b1, lm_data.train_batch(c, 6, 4, 32, seed=0))
    v = lm_data.val_batches(c, 2, 4, 32)
    assert len(v) == 2 and all(x.shape == (4, 33) for x in v)


# ---- --moe -----------------------------------------------------------------------------------------------------------
MOE_CFG = dict(d_model=64, n_heads=2, seq=32, moe_experts=4, moe_top_k=2)


def test_moe_flags():
    m = train_lm.parse_args(["--moe"])[1].model
    assert (m.moe_experts, m.moe_top_k, m.moe_aux_weight) == (8, 2, 0.01)
    m = train_lm.parse_args(["--moe", "4", "--top-k", "1", "--aux-weight", "0"])[1].model
    assert (m.moe_experts, m.moe_top_k, m.moe_aux_weight) == (4, 1, 0.0)
    assert train_lm.parse_args(["--moe", "--mesh", "1x1"])[1].mesh == (1, 1, 1, 1)  # data parallel: allowed
    dense = train_lm.parse_args([])[1]
    assert not dense.model.moe and not any(k.startswith("moe") for k in dense.resume_key()["model"])
    # nvfp4-1x64's experts: 1D NVFP4 for the grouped token operand of fprop; every other recipe unchanged
    r = recipes.NVFP4_1x64()
    e = lm_model.expert_recipe(r)
    assert e.fprop_x == NVFP4Format() and e.formats()[1:] == r.formats()[1:]
    assert lm_model.expert_recipe(recipes.NVFP4()) == recipes.NVFP4()


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_moe_loss_falls(tmp_path, capsys, recipe):
    summary = train_lm.main([*FAST, "--recipe", recipe, "--moe", "4", "--steps", "20", "--out", str(tmp_path)])[recipe]
    assert "moe: every MLP 4 experts, top-2 per token" in capsys.readouterr().out
    rows = _rows(tmp_path)
    losses = [float(r["train_loss"]) for r in rows]
    aux = [float(r["aux_loss"]) for r in rows]
    assert len(losses) == 20 and np.all(np.isfinite(losses)), losses
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    assert last < first - 0.5, (first, last, losses)
    assert np.isfinite(summary["val_loss"]) and summary["val_loss"] < first
    # E * sum_e f_e P_e: 1 when balanced, <= E; the router starts near uniform
    assert np.all(np.isfinite(aux)) and 0.9 < aux[0] < 1.5 and max(aux) < 4, aux
    assert summary["aux_loss"] == pytest.approx(aux[-1])


def test_moe_scan_layers():
    """Stacked MoE blocks under nnx.scan compute the unrolled blocks' loss and load-balancing loss."""
    cfg, scfg = (lm_model.ModelConfig(n_layers=2, scan_layers=s, **MOE_CFG) for s in (False, True))
    unrolled, scanned = lm_model.make_model(cfg, recipes.BF16(), 0), lm_model.make_model(scfg, recipes.BF16(), 0)
    p = nnx.to_pure_dict(nnx.state(unrolled, nnx.Param))
    assert p["blocks"][0]["mlp"]["up"]["kernel"].shape == (4, 64, 256)
    blocks = p.pop("blocks")
    p["stacks"] = {0: jax.tree.map(lambda *layers: np.stack(layers), *(blocks[i] for i in range(2)))}
    _bits_equal_trees(nnx.to_pure_dict(nnx.state(scanned, nnx.Param)), p)  # the same initial weights
    batch = lm_data.train_batch(lm_data.Corpus(np.arange(4096, dtype=np.uint8), np.zeros(64, np.uint8), ""), 0, 4,
                                32, seed=0)
    terms = nnx.jit(lm_model.loss_terms)
    (_, (ce_s, aux_s, _)), (obj_u, (ce_u, aux_u, seq_u)) = terms(scanned, batch), terms(unrolled, batch)
    assert seq_u.shape == (4,) and float(seq_u.mean()) == pytest.approx(float(ce_u), rel=1e-5)
    np.testing.assert_allclose([ce_s, aux_s], [ce_u, aux_u], rtol=2e-3)
    assert float(obj_u) == pytest.approx(float(ce_u) + 0.01 * float(aux_u), rel=1e-6) and 0.9 < float(aux_u) < 2


def test_moe_resume(tmp_path, capsys):
    flags = [*FAST, "--recipe", "bf16", "--moe", "4", "--top-k", "1", "--out", str(tmp_path)]
    train_lm.main([*flags, "--steps", "3"])
    train_lm.main([*flags, "--steps", "5", "--resume"])
    assert "bf16: resumed from" in capsys.readouterr().out
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [str(s) for s in range(1, 6)] and all(r["aux_loss"] for r in rows)
    with pytest.raises(SystemExit, match="moe_experts 4 \\(now None\\)"):
        train_lm.main([*FAST, "--recipe", "bf16", "--steps", "5", "--resume", "--out", str(tmp_path)])
