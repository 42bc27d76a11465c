"""jax_fp4.policy (rules over module paths) and jax_fp4.flax.policy (applied to NNX and Linen models) on the CPU.

* matching: globs ("*" crosses "/"), "re:" regexes, ancestors ("blocks/3" covers its sublayers), first match wins,
  rules with recipe None shield layers from later rules, the default and the layer's own recipe;
* the usual forms (first / last N blocks, a fraction, MLP-only, exclude) give the expected table on an NNX GPT;
* a rule that matches nothing raises UnmatchedRuleError naming it; bad rules raise at construction;
* policies are hashable and usable as jit static arguments; `apply` changes the graphdef only (same state), and a
  second apply of the same policy gives an equal graphdef (no recompilation);
* drop-in: nnx.Linear layers get a drop-in dot_general of their recipe, equal to jax_fp4's Dense;
* Linen: a Policy as the recipe of jax_fp4.flax.linen layers resolves per layer (equal to the layers built with those
  recipes), `linen_dot_general` in nn.Dense, `describe_linen` tables and errors.
Everything except the last two checks traces no quantized GEMM (the layers are only built / described).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("flax")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jax_fp4 import policy as P  # noqa: E402
from jax_fp4 import recipes  # noqa: E402
from jax_fp4.flax import linen as flinen  # noqa: E402
from jax_fp4.flax import nnx as fnnx  # noqa: E402
from jax_fp4.flax import policy as FP  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "lm"))
import lm_model  # noqa: E402

BF16, MX, NV = recipes.BF16(), recipes.MXFP8(), recipes.NVFP4Fwd_MXFP8Bwd()


def test_rule_matching():
    r = P.Rule("blocks/3", BF16)
    assert r.matches("blocks/3/mlp/up") and r.matches("blocks/3") and not r.matches("blocks/30/mlp")
    assert P.Rule("*/mlp", BF16).matches("blocks/0/mlp/down") and not P.Rule("*/mlp", BF16).matches("blocks/0/out")
    assert P.Rule("*", BF16).matches("head")
    assert P.Rule("re:blocks/(0|11)", BF16).matches("blocks/11/qkv/dense")
    assert not P.Rule("re:blocks/(0|11)", BF16).matches("blocks/1/qkv/dense")
    assert P.Rule("re:.*/up", BF16).matches(("blocks", 2, "mlp", "up"))  # tuple paths are joined with "/"
    pol = P.Policy((("blocks/1", BF16), ("*/mlp", MX)), NV)
    assert pol.resolve("blocks/1/mlp/up") == BF16  # first match wins
    assert pol.resolve("blocks/0/mlp/up") == MX
    assert pol.resolve("blocks/0/out") == NV  # the default
    assert P.Policy((("*/mlp", MX),)).resolve("blocks/0/out", current=BF16) == BF16  # no default: own recipe
    with pytest.raises(ValueError, match="no recipe for layer 'blocks/0/out'"):
        P.Policy((("*/mlp", MX),)).resolve("blocks/0/out")
    only = P.mlp_only()  # the MLP keeps the default / own recipe, everything else BF16
    assert only.resolve("blocks/0/mlp/up", current=NV) == NV and only.resolve("blocks/0/qkv/dense", NV) == BF16


def test_forms_and_composition():
    assert [r.pattern for r in P.last_blocks(2, num_blocks=5).rules] == ["blocks/3", "blocks/4"]
    assert P.first_blocks(1, MX).rules == (P.Rule("blocks/0", MX),)
    assert [r.pattern for r in P.last_fraction(0.15, num_blocks=12).rules] == ["blocks/10", "blocks/11"]
    assert [r.pattern for r in P.last_fraction(0.25, num_blocks=4).rules] == ["blocks/3"]
    assert P.last_fraction(0.0, num_blocks=4).rules == ()
    assert [r.pattern for r in P.last_blocks(1, num_blocks=3, block="blocks_{i}").rules] == ["blocks_2"]
    both = P.last_blocks(1, num_blocks=3) + P.exclude(["*/out", "*/qkv"], MX) + P.uniform(NV)
    assert both.default == NV and [r.pattern for r in both.rules] == ["blocks/2", "*/out", "*/qkv"]
    assert both.map(lambda r: MX).default == MX
    with pytest.raises(ValueError, match="last_blocks: 4 blocks of 3"):
        P.last_blocks(4, num_blocks=3)
    with pytest.raises(ValueError, match="fraction must be in"):
        P.last_fraction(1.5, num_blocks=3)
    with pytest.raises(ValueError, match="bad regular expression"):
        P.Rule("re:blocks/(", BF16)
    with pytest.raises(TypeError, match="recipe must be a jax_fp4.recipes.Recipe"):
        P.Rule("x", 3)
    assert P.Rule("x", "bf16").recipe == BF16  # a recipe name, as everywhere
    with pytest.raises(TypeError, match="a rule must be a Rule or a"):
        P.Policy(("x",))


def test_hashable_static():
    a = P.last_blocks(1, num_blocks=3) + P.uniform(NV)
    b = P.last_blocks(1, num_blocks=3) + P.uniform(NV)
    assert a == b and hash(a) == hash(b) and a != P.uniform(NV)
    calls = []

    @jax.jit
    def f(x, pol):
        calls.append(pol)
        return x * len(pol.rules)

    f = jax.jit(f.__wrapped__, static_argnums=1)
    assert float(f(jnp.float32(2), a)) == 2.0 and float(f(jnp.float32(3), b)) == 3.0
    assert len(calls) == 1  # b == a: the cached trace


def _gpt(n_layers=3, recipe=NV, scan=False):
    cfg = lm_model.ModelConfig(d_model=64, n_layers=n_layers, n_heads=2, seq=32, scan_layers=scan)
    return lm_model.make_model(cfg, recipe, 0)


def test_nnx_apply_and_describe():
    model = _gpt()
    pol = P.last_blocks(1, num_blocks=3) + P.exclude("*/out", MX)
    g0, s0 = nnx.split(model)
    table = FP.describe(pol, model)
    lines = {ln.split()[0]: ln.split()[1:] for ln in table.splitlines()[2:]}
    assert len(lines) == 12  # 3 blocks x (qkv, out, mlp up, mlp down)
    assert lines["blocks/2/mlp/up"] == ["bf16", "'blocks/2'"] and lines["blocks/2/out"][0] == "bf16"
    assert lines["blocks/0/out"] == ["mxfp8", "'*/out'"] and lines["blocks/1/qkv/dense"][0] == NV.name
    out = FP.apply(pol, model)
    assert out["blocks/2/qkv/dense"] == BF16 and model.blocks[2].qkv.dense.recipe == BF16
    assert model.blocks[0].out.recipe == MX and model.blocks[0].mlp.up.recipe == NV
    g1, s1 = nnx.split(model)
    assert g1 != g0 and jax.tree.structure(s1) == jax.tree.structure(s0)  # only the static definition changed
    FP.apply(pol, model)
    assert nnx.split(model)[0] == g1  # the same policy again: the same graphdef (jit cache hit)
    # MLP-only on the same (already applied) model: the MLPs keep their own recipe
    FP.apply(P.mlp_only(), model)
    assert model.blocks[0].mlp.down.recipe == NV and model.blocks[0].qkv.dense.recipe == BF16


def test_unmatched_rule():
    model = _gpt()
    with pytest.raises(P.UnmatchedRuleError, match=r"rule 'blocks/7' matches no layer of the model.*blocks/0/mlp/down"):
        FP.apply(P.exclude("blocks/7") + P.exclude("*/mlp"), model)
    with pytest.raises(P.UnmatchedRuleError, match=r"rules 'blocks/5', 're:head' match no layer"):
        FP.describe(P.last_blocks(1, num_blocks=6) + P.exclude("re:head"), model)
    # scanned blocks have one path per stack: without `stacks=` (tests/test_policy_segments.py) per-block rules match
    # nothing (a clear error, not a silent no-op)
    with pytest.raises(P.UnmatchedRuleError, match="stacks/0/qkv/dense"):
        FP.apply(P.last_blocks(1, num_blocks=3), _gpt(scan=True))
    assert FP.apply(P.exclude("stacks/0/out"), _gpt(scan=True))["stacks/0/out"] == BF16


def test_stochastic_rounding_streams():
    model = _gpt(n_layers=1, recipe=MX)
    with pytest.raises(ValueError, match="uses stochastic rounding, but was built with a deterministic recipe"):
        FP.apply(P.exclude("*/out", recipes.NVFP4()), model)
    FP.apply(P.exclude("*/out", recipes.NVFP4()), model, rngs=nnx.Rngs(quantize=5))
    assert model.blocks[0].out.rngs is not None and model.blocks[0].mlp.up.rngs is None


def test_drop_in_nnx():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.enc = nnx.Linear(64, 64, rngs=rngs)
            self.head = nnx.Linear(64, 32, rngs=rngs)

    net = Net(nnx.Rngs(0))
    with pytest.raises(P.UnmatchedRuleError, match="drop_in=True"):
        FP.apply(P.exclude("enc", MX), net)
    assert FP.assignments(P.exclude("enc", MX), net, drop_in=True) == {"enc": MX, "head": None}
    FP.apply(P.exclude("enc", MX), net, drop_in=True)
    assert net.enc.dot_general == FP.PolicyDotGeneral(MX) and net.head.dot_general is not net.enc.dot_general
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 64)), jnp.float32)
    dense = fnnx.Dense(64, 64, recipe=MX, rngs=nnx.Rngs(1))
    nnx.update(dense, nnx.state(net.enc))
    np.testing.assert_array_equal(net.enc(x), dense(x))


def test_linen_policy():
    pol = P.Policy((("mlp/up", BF16),), MX)

    class M(nn.Module):
        pol: P.Policy

        @nn.compact
        def __call__(self, x):
            x = flinen.LayerNormMLP(64, self.pol, name="mlp")(x)
            return nn.Dense(64, dot_general=FP.linen_dot_general(self.pol), name="head")(x)

    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 32, 64)), jnp.float32)
    table = FP.describe_linen(pol, M(pol), x)
    assert [ln.split()[:2] for ln in table.splitlines()[2:]] == [["mlp/up", "bf16"], ["mlp/down", "mxfp8"],
                                                                 ["head", "mxfp8"]]
    with pytest.raises(P.UnmatchedRuleError, match="'mlp/gate' matches no layer of M"):
        bad = pol + P.exclude("mlp/gate")
        FP.describe_linen(bad, M(bad), x)
    with pytest.raises(ValueError, match="inside jax_fp4.flax.policy.linen_module_paths"):
        M(pol).init(jax.random.key(0), x)
    with FP.linen_module_paths():
        v = M(pol).init(jax.random.key(0), x)
        y = M(pol).apply(v, x)
    # the same with explicit recipes
    up = flinen.Dense(64, BF16).apply({"params": v["params"]["mlp"]["up"]},
                                      nn.LayerNorm(epsilon=1e-6).apply({"params": v["params"]["mlp"]["norm"]}, x))
    hid = flinen.Dense(64, MX).apply({"params": v["params"]["mlp"]["down"]}, jax.nn.gelu(up))
    ref = flinen.Dense(64, MX).apply({"params": v["params"]["head"]}, hid)
    np.testing.assert_array_equal(y, ref)
