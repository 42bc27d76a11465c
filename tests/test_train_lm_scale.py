"""examples/lm/train_lm.py at scale, on the CPU: the Llama-style presets, fsdp meshes, scanned segments, remat, the BPE
tokenizer and resuming on another mesh.

* the large (~1B) and large-350m presets: parameter counts and FLOPs by abstract evaluation (nnx.eval_shape, no
  FLOPs), the loss's shape, the fsdp annotations of every matrix and of the AdamW moments; mesh validation;
* a per-block policy on scanned blocks compiles to one scan per segment, starts from the unscanned model's weights and
  computes its loss and gradients (bf16 last block over mxfp8, gpt and llama blocks);
* remat "quantized" saves the quantized GEMM residuals (their checkpoint names) and bf16 layers' inputs, and every
  remat choice gives the gradients of "none";
* the BPE tokenizer trains deterministically (same tokenizer.json and ids twice), round-trips text and is cached;
* on 4 forced CPU devices (a subprocess): an mxfp8 run on an fsdp mesh (1x4x1: parameters and AdamW moments split over
  "fsdp", every quantized layer's recipe a `jax_fp4.distributed.shard_recipe` over "fsdp") stopped at step 2 and
  resumed on 2x1x2 (data x tensor) follows an uninterrupted one-device run (the first loss within the float32
  summation bound, the rest within the bf16 layers' rounding); its --collectives record shows the weight all-gathers
  and the reductions.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # example harness end to end (fsdp meshes, remat, presets): full suite only
pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "lm"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import lm_data  # noqa: E402
import lm_layers  # noqa: E402
import lm_mesh  # noqa: E402
import lm_model  # noqa: E402
import lm_tokenizer  # noqa: E402
import train_lm  # noqa: E402
from flax import nnx  # noqa: E402

from jax_fp4 import policy as P  # noqa: E402
from jax_fp4 import recipes  # noqa: E402
from jax_fp4.flax import policy as FP  # noqa: E402

NV, MX, BF = recipes.NVFP4Fwd_MXFP8Bwd(), recipes.MXFP8(), recipes.BF16()
TINY_LLAMA = dict(d_model=64, n_layers=3, n_heads=2, kv_heads=1, mlp_hidden=128, seq=32, arch="llama")


@pytest.mark.parametrize("preset,low,high", [("large", 0.95e9, 1.1e9), ("large-350m", 0.3e9, 0.4e9)])
def test_large_presets(preset, low, high):
    _, cfg, _ = train_lm.parse_args(["--preset", preset])
    m = cfg.model
    assert (m.arch, m.seq, m.vocab, m.scan_layers, m.remat) == ("llama", 2048, 32768, True, "quantized")
    assert m.n_heads % m.kv == 0 and m.kv < m.n_heads and m.head_dim in (64, 128)
    n = lm_model.count_params(m)
    assert low <= n <= high, n
    # 6 x (the GEMM weights but the embedding) + the attention products
    attn = 12 * m.n_layers * m.d_model * m.seq
    assert lm_model.flops_per_token(m) == pytest.approx(6 * (n - m.vocab * m.d_model - 2 * m.n_layers * m.d_model
                                                             - m.d_model) + attn, rel=1e-9)
    mesh = jax.sharding.AbstractMesh((1, 2, 1, 1), lm_mesh.AXES)
    model = nnx.eval_shape(lambda: lm_model.make_model(m, NV, 0, mesh=mesh, segments=((0, 4), (4, m.n_layers))))
    batch = jax.ShapeDtypeStruct((cfg.batch, m.seq + 1), jnp.uint16)
    loss = jax.eval_shape(lambda mdl, b: lm_model.loss_fn(mdl, b), model, batch)
    assert loss.shape == () and loss.dtype == jnp.float32
    opt = nnx.eval_shape(lambda: nnx.Optimizer(model, lm_model.make_optimizer(lm_model.OptConfig()), wrt=nnx.Param))
    flat = jax.tree_util.tree_flatten_with_path(nnx.get_partition_spec(nnx.state((model, opt))),
                                                is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]
    specs = {jax.tree_util.keystr(k).removesuffix(".value"): tuple(v) for k, v in flat}
    mats = {k: v for k, v in specs.items() if k.endswith(("['kernel']", "['embedding']"))}
    assert len(mats) == 3 * (2 + 2 * 4)  # params, mu, nu of embed, head and 2 stacks x (qkv, out, up, down)
    for k, v in mats.items():
        assert "fsdp" in v and len(v) == (3 if "stacks" in k else 2), (k, v)
        if "stacks" in k:
            assert v[0] is None and v[1:] == (("fsdp", "tensor") if k.split("]")[-3][2:-1] in ("qkv", "up")
                                              else ("tensor", "fsdp")), (k, v)


def test_large_meshes():
    _, cfg, _ = train_lm.parse_args(["--preset", "large"])
    m = cfg.model
    for shape in [(1, 2, 1), (2, 1, 1), (1, 8, 1), (2, 2, 2), (1, 4, 2), (1, 2, 4)]:
        assert lm_mesh.mesh_problems(m, cfg.batch, *shape) == [], shape
    assert "do not split over the tensor axis (8)" in lm_mesh.mesh_problems(m, cfg.batch, 1, 1, 8)[0]  # 4 kv heads
    assert "does not split over the data x fsdp axes (1 x 3)" in lm_mesh.mesh_problems(m, cfg.batch, 1, 3, 1)[0]
    odd = dataclasses.replace(m, mlp_hidden=7168 + 128)
    assert any("the MLP width 7296 does not split over the fsdp axis (8)" in e
               for e in lm_mesh.mesh_problems(odd, cfg.batch, 1, 8, 1))


def _batch(vocab, seq=32, rows=4):
    return jnp.asarray(np.random.default_rng(0).integers(0, vocab, (rows, seq + 1)), jnp.int32)


def _model(cfg, policy, scan):
    """A float32-compute model (no bfloat16 rounding: layouts compare bit for bit) with the policy applied."""
    cfg = dataclasses.replace(cfg, scan_layers=scan)
    model = lm_model.make_model(cfg, MX, 0, segments=lm_model.segments_for(cfg, MX, [policy]), dtype=jnp.float32)
    FP.apply(policy, model, stacks=model.stacks_map())
    return model


def _close(a, b, tol):
    """Bit for bit (tol 0), or ||a - b|| <= tol ||b||."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if tol == 0:
        np.testing.assert_array_equal(a, b)
    else:
        assert np.linalg.norm(a - b) <= tol * np.linalg.norm(b), (np.linalg.norm(a - b) / np.linalg.norm(b), tol)


def _assert_blocks_equal(unrolled, stacked, segments, tol=0.0):
    """Block i of the unrolled tree equals its row of the stack holding it (see _close)."""
    for i in range(len(unrolled["blocks"])):
        seg = next(j for j, (a, b) in enumerate(segments) if a <= i < b)
        jax.tree.map(lambda a, b, r=i - segments[seg][0]: _close(a, np.asarray(b)[r], tol), unrolled["blocks"][i],
                     stacked["stacks"][seg])


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_scanned_segments_equal_unscanned(arch):
    """bf16 in the last block, mxfp8 elsewhere: the scanned model runs two scans (blocks 0-1, block 2) with the
    layer recipes of the unrolled model, from its weights (bit for bit), to its loss and gradients.

    Float32 compute: XLA orders a few float32 sums differently in the scan body than unrolled (1-ulp differences
    seen), each a sum over <= 128 tokens or features: relative error <= 128 * 2^-24 < 2^-16 per sum; the bound
    2^-12 of the gradient norm leaves room for the chain of layers and fails where a layer took another recipe
    (an MXFP8 code differs from its input by up to 2^-4) or another weight."""
    kw = TINY_LLAMA if arch == "llama" else dict(d_model=64, n_layers=3, n_heads=2, seq=32)
    cfg = lm_model.ModelConfig(**kw)
    pol = P.last_blocks(1, num_blocks=3).with_default(MX)
    un, sc = _model(cfg, pol, False), _model(cfg, pol, True)
    assert sc.segments == ((0, 2), (2, 3)) and len(sc.stacks) == 2
    layers = {"/".join(map(str, p)): n.recipe.name for p, n in nnx.iter_graph(sc) if type(n).__name__ == "Dense"}
    assert {r for k, r in layers.items() if k.startswith("stacks/0/")} == {"mxfp8"}
    assert {r for k, r in layers.items() if k.startswith("stacks/1/")} == {"bf16"}
    _assert_blocks_equal(*(nnx.to_pure_dict(nnx.state(m, nnx.Param)) for m in (un, sc)), sc.segments)
    batch = _batch(cfg.vocab)
    vg = nnx.jit(nnx.value_and_grad(lm_model.loss_fn))
    (lu, gu), (ls, gs) = vg(un, batch), vg(sc, batch)
    assert float(ls) == pytest.approx(float(lu), rel=2.0**-16)
    gu, gs = nnx.to_pure_dict(gu), nnx.to_pure_dict(gs)
    _assert_blocks_equal(gu, gs, sc.segments, tol=2.0**-12)
    for k in ("embed", "head", "norm"):
        jax.tree.map(lambda a, b: _close(a, b, 2.0**-12), gu[k], gs[k])


@pytest.mark.parametrize("arch,scan", [("gpt", False), ("llama", True)])
def test_distinct_attention_sites_change_no_bits(arch, scan):
    """ModelConfig.distinct_attention (train_lm --deterministic --attention cudnn): every unrolled block, or every
    scanned segment, is its own attention site with its own full causal window (distinct cuDNN graphs under XLA's
    deterministic ops), and the loss and gradients are those of plain causal attention bit for bit (XLA's attention
    on the CPU)."""
    kw = TINY_LLAMA if arch == "llama" else dict(d_model=64, n_layers=3, n_heads=2, seq=32)
    pol = P.last_blocks(1, num_blocks=3).with_default(MX)
    plain = _model(lm_model.ModelConfig(**kw, attention="cudnn"), pol, scan)
    dist = _model(lm_model.ModelConfig(**kw, attention="cudnn", distinct_attention=True), pol, scan)
    sites = [m.attention_site for m in (dist.stacks if scan else dist.blocks)]
    assert sites == list(range(2 if scan else 3))  # scanned: blocks 0-1 and block 2
    assert {m.attention_site for m in (plain.stacks if scan else plain.blocks)} == {None}
    vg = nnx.jit(nnx.value_and_grad(lm_model.loss_fn))
    batch = _batch(plain.cfg.vocab)
    (lp, gp), (ld, gd) = vg(plain, batch), vg(dist, batch)
    assert float(ld) == float(lp)
    jax.tree.map(lambda a, b: _close(a, b, 0), nnx.to_pure_dict(gd), nnx.to_pure_dict(gp))


def test_remat_keeps_quantized_residuals(capsys):
    """remat "quantized": the saved residuals are the quantized GEMM operands (jax_fp4_x_wgrad, jax_fp4_w_dgrad),
    for a bf16 block the GEMM inputs (lm_gemm_input); every remat choice gives the gradients of "none" (float32
    compute: bit for bit)."""
    batch = _batch(256)
    pol = P.last_blocks(1, num_blocks=2).with_default(MX)
    grads = {}
    for remat in lm_layers.REMAT:
        model = _model(lm_model.ModelConfig(**{**TINY_LLAMA, "n_layers": 2}, remat=remat), pol, False)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p, graphdef=graphdef, rest=rest):
            return lm_model.loss_fn(nnx.merge(graphdef, p, rest), batch)

        if remat == "quantized":
            jax.ad_checkpoint.print_saved_residuals(loss, params)
            saved = capsys.readouterr().out
            assert saved.count("named 'jax_fp4_x_wgrad'") >= 4 and saved.count("named 'jax_fp4_w_dgrad'") >= 4
            assert saved.count("named 'lm_gemm_input'") == 4, saved  # block 1: bf16 (the policy), 4 GEMMs
        grads[remat] = jax.jit(jax.grad(loss))(params)
    for remat in ("quantized", "full"):
        jax.tree.map(np.testing.assert_array_equal, grads[remat], grads["none"])


def _text(n_files=40):
    files = [f for f in lm_data.stdlib_files() if f.parts[0] == "json" or f.name.startswith("a")][:n_files]
    root = lm_data.stdlib_root()
    data = np.frombuffer(b"".join((root / f).read_bytes() + b"\n" for f in files), np.uint8)
    return lm_data.Corpus(data[: data.size * 9 // 10], data[data.size * 9 // 10:], "test")


def test_tokenizer_deterministic(tmp_path):
    corpus = _text()
    train = lm_tokenizer._chunks(corpus.train)
    a, b = (lm_tokenizer.train_bpe(train, 600) for _ in range(2))
    assert a.to_str() == b.to_str() and a.get_vocab_size() == 600
    ids = lm_tokenizer.encode(a, corpus.val)
    np.testing.assert_array_equal(ids, lm_tokenizer.encode(b, corpus.val))
    assert ids.dtype == np.uint16 and ids.max() < 600 and ids.size < corpus.val.size / 2  # merges shorten the text
    assert a.decode(ids.tolist()) == corpus.val.tobytes().decode()
    c1 = lm_tokenizer.tokenize_corpus(corpus, 600, tmp_path, log=lambda s: None)
    assert len(list(tmp_path.glob("bpe-600-*.json"))) == 1
    logs = []
    c2 = lm_tokenizer.tokenize_corpus(corpus, 600, tmp_path, log=logs.append)
    assert "(cached)" in logs[0]
    np.testing.assert_array_equal(c1.val, ids)
    np.testing.assert_array_equal(c1.train, c2.train)
    assert c1.vocab == 600 and c1.bytes_per_token == pytest.approx(corpus.val.size / ids.size)
    with pytest.raises(ValueError, match="vocab_size 256 must be in"):
        lm_tokenizer.train_bpe(train, 256)


MESH_SCRIPT = r"""
import sys, json
sys.path.insert(0, "examples/lm")
import jax, train_lm, lm_model, lm_mesh
from jax_fp4 import recipes
out = sys.argv[1]
flags = ["--preset", "tiny", "--arch", "llama", "--d-model", "128", "--heads", "4", "--kv-heads", "2",
         "--mlp-hidden", "256", "--scan", "--layers", "1", "--batch", "8", "--seq", "64", "--lr", "1e-2",
         "--warmup", "1", "--log-every", "1", "--eval-every", "1000", "--eval-batches", "1", "--no-progress",
         "--recipe", "mxfp8", "--steps", "4"]
train_lm.main([*flags, "--out", out + "/one"])
train_lm.main([*flags, "--mesh", "1x4x1", "--stop-at", "2", "--collectives", "--out", out + "/moved"])
print("COLL " + json.dumps(json.load(open(out + "/moved/summary.json"))["mxfp8"]["collectives"]))
# the fsdp state: the AdamW moments are split like the parameters
_, cfg, _ = train_lm.parse_args([*flags, "--mesh", "1x4x1"])
_, state, _ = lm_model.build(cfg.model, recipes.MXFP8(), lm_model.OptConfig(), 0, lm_mesh.make_mesh(1, 4, 1))
specs = {jax.tree_util.keystr(k): str(v.sharding.spec) for k, v in jax.tree_util.tree_flatten_with_path(state)[0]
         if "kernel" in jax.tree_util.keystr(k)}
print("SPECS " + json.dumps(specs))
# the quantized layers gather their weights' codes and scales over fsdp (jax_fp4.distributed.shard_recipe)
from flax import nnx
from jax_fp4.flax import policy as fpolicy

model, _ = nnx.merge(*lm_model.build(cfg.model, recipes.MXFP8(), lm_model.OptConfig(), 0, lm_mesh.make_mesh(1, 4, 1),
                                     "output")[:2])
print("RECIPES " + json.dumps({p: [type(l.recipe).__name__, list(getattr(l.recipe, "fsdp_axes", ())),
                                   getattr(l.recipe, "reduce_dtype", None)] for p, l in fpolicy.layers(model).items()}))
train_lm.main([*flags, "--mesh", "2x1x2", "--resume", "--out", out + "/moved"])
"""


def test_fsdp_mesh_and_resume_across_meshes(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-P", "-c", MESH_SCRIPT, str(tmp_path)], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    lines = proc.stdout.splitlines()
    specs = json.loads(next(ln[6:] for ln in lines if ln.startswith("SPECS ")))
    assert specs and all("fsdp" in v for v in specs.values()), specs  # parameters and both AdamW moments
    assert sum(k.startswith("[1]") for k in specs) == 2 * sum(k.startswith("[0]") for k in specs) > 0  # mu, nu
    layer_recipes = json.loads(next(ln[8:] for ln in lines if ln.startswith("RECIPES ")))
    assert layer_recipes and all(v == ["ShardedRecipe", ["fsdp"], "output"] for v in layer_recipes.values())
    assert "mxfp8: the quantized layers gather their weights' codes and block scales over fsdp" in proc.stdout
    # --collectives: the fsdp weights are gathered, gradients and amaxes reduced (the compiled step's HLO)
    coll = json.loads(next(ln[5:] for ln in lines if ln.startswith("COLL ")))
    assert coll["all-gather"]["count"] > 0 and coll["all-gather"]["bytes"] > 0, coll
    assert coll["all-reduce"]["count"] > 0, coll
    assert "mxfp8: resumed from" in proc.stdout and "mesh: data 2 x fsdp 1 x tensor 2 over 4 devices" in proc.stdout

    def losses(name):
        with (tmp_path / name / "curves.csv").open(newline="") as f:
            return [float(r["train_loss"]) for r in csv.DictReader(f)]

    one, moved = losses("one"), losses("moved")
    assert len(one) == len(moved) == 4
    # step 1 (fsdp): the same quantized operands, float32 sums in another order (test_sharding_train.py's bound)
    n = 8 * 64
    assert abs(moved[0] - one[0]) <= 2 * (n - 1) * 2.0**-24 * one[0], (moved[0], one[0])
    # later steps: the bf16 layers (norms, attention, embedding, head) round sharded partial sums differently
    np.testing.assert_allclose(moved, one, rtol=2e-2)
