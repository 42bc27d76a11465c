"""jax_fp4.qwix: the qwix provider equals jax_fp4's layer path bit for bit (NNX and Linen, jit, nnx.scan, remat,
ragged_dot), leaves unmatched calls alone, and reports what it cannot quantize."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest
from _optional_import import check_optional_import

pytest.importorskip("flax")
qwix = pytest.importorskip("qwix")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _qwix_models import LinenStack, NnxBlock, NnxMoE, NnxStack  # noqa: E402
from flax import nnx  # noqa: E402

from jax_fp4.blocking import BlockingError  # noqa: E402
from jax_fp4.flax import make_dot_general  # noqa: E402
from jax_fp4.policy import Policy  # noqa: E402
from jax_fp4.qwix import Fp4Provider, Fp4Rule, UnquantizedOpWarning, set_rngs  # noqa: E402
from jax_fp4.qwix.ragged import aligned_ragged_dot  # noqa: E402
from jax_fp4.recipes import by_name  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:The 'm.iter_modules:DeprecationWarning")  # qwix 0.1.8 calls it

RECIPES = ["bf16", "mxfp8", "nvfp4-fwd-mxfp8-bwd", "nvfp4"]
D = 32


def _bits(tree):
    """{path: the array's bytes as unsigned ints} (so that -0.0 / +0.0 and NaN payloads count)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        a = np.asarray(leaf)
        out[jax.tree_util.keystr(path)] = a.view(np.dtype(f"u{a.dtype.itemsize}"))
    return out


def _assert_same(a, b):
    ba, bb = _bits(a), _bits(b)
    assert ba.keys() == bb.keys()
    for k in ba:
        np.testing.assert_array_equal(ba[k], bb[k], err_msg=k)


def _nnx_train(model, x, steps=2):
    """Losses and gradients of `steps` SGD steps under nnx.jit (the rng streams advance as state)."""

    @nnx.jit
    def step(m, x):
        loss, g = nnx.value_and_grad(lambda m: jnp.mean(jnp.square(m(x).astype(jnp.float32))))(m)
        nnx.update(m, jax.tree.map(lambda p, d: p - 0.5 * d, nnx.state(m, nnx.Param), g))
        return loss, g

    return [step(model, x) for _ in range(steps)]


def _quantized(model, rules, x):
    return qwix.quantize_model(model, Fp4Provider(rules), x, skip_nnx_init=True)


@pytest.mark.parametrize("recipe", RECIPES)
def test_nnx_linear_and_einsum_equal_layer_path(recipe):
    x = jax.random.normal(jax.random.key(1), (2, 16, D), jnp.float32)
    ref = NnxBlock(D, nnx.Rngs(params=0, quantize=1), recipe)
    qm = _quantized(NnxBlock(D, nnx.Rngs(params=0, quantize=1)), [Fp4Rule(recipe=recipe)], x)
    set_rngs(qm, qm.q)
    _assert_same(_nnx_train(ref, x), _nnx_train(qm, x))


@pytest.mark.parametrize("recipe", RECIPES)
def test_nnx_scan_remat_equal_layer_path(recipe):
    x = jax.random.normal(jax.random.key(2), (2, 16, D), jnp.float32)
    ref = NnxStack(D, 2, nnx.Rngs(params=0, quantize=1), recipe)
    qm = _quantized(NnxStack(D, 2, nnx.Rngs(params=0, quantize=1)), [Fp4Rule(recipe=recipe)], x)
    set_rngs(qm, qm.blocks.q, where=lambda p: p[:1] == ("blocks",))  # a stream per block, scanned with it
    set_rngs(qm, qm.head_q, where=lambda p: p[:1] != ("blocks",))
    _assert_same(_nnx_train(ref, x), _nnx_train(qm, x))


@pytest.mark.parametrize("recipe", RECIPES)
def test_linen_jit_remat_equal_layer_path(recipe):
    x = jax.random.normal(jax.random.key(3), (2, 16, D), jnp.float32)
    ref = LinenStack(D, 2, recipe)
    qm = qwix.quantize_model(LinenStack(D, 2), Fp4Provider([Fp4Rule(recipe=recipe)]))

    def train(model):
        params = model.init(jax.random.key(0), x)["params"]

        @jax.jit
        def step(params, k):
            def loss(p):
                return jnp.mean(jnp.square(model.apply({"params": p}, x, rngs={"quantize": k})))

            val, g = jax.value_and_grad(loss)(params)
            return val, g, jax.tree.map(lambda p, d: p - 0.5 * d, params, g)

        out = []
        for k in jax.random.split(jax.random.key(9), 2):
            val, g, params = step(params, k)
            out.append((val, g))
        return out

    _assert_same(train(ref), train(qm))


@pytest.mark.parametrize("recipe", RECIPES)
def test_moe_ragged_dot_equals_layer_path(recipe):
    """The router's group sizes are not multiples of the wgrad block: the provider pads them as
    jax_fp4.flax.moe.dispatch does, so its quantized ragged_dots equal jax_fp4.ragged_dot on the padded groups."""
    x = jax.random.normal(jax.random.key(4), (32, D), jnp.float32)
    ref = NnxMoE(D, D, 4, 2, nnx.Rngs(params=0, quantize=1), recipe)
    qm = _quantized(NnxMoE(D, D, 4, 2, nnx.Rngs(params=0, quantize=1)),
                    [Fp4Rule(module_path="router", recipe="bf16"), Fp4Rule(recipe=recipe)], x)
    set_rngs(qm, qm.q)
    _assert_same(_nnx_train(ref, x), _nnx_train(qm, x))


def test_policy_rule_and_unmatched_calls():
    """A rule's Policy resolves per module path; calls no rule matches (and conv, never intercepted) are
    unchanged; every rule matched something."""
    x = jax.random.normal(jax.random.key(5), (2, 16, D), jnp.float32)
    pol = Policy((("up", "bf16"),), default="mxfp8")
    provider = Fp4Provider([Fp4Rule(module_path="proj|up", recipe=pol)])
    qm = qwix.quantize_model(NnxBlock(D, nnx.Rngs(params=0, quantize=1)), provider, x)
    ref = NnxBlock(D, nnx.Rngs(params=0, quantize=1))
    ref.proj.einsum_op = lambda s, *ops, **kw: jnp.einsum(s, *ops, _dot_general=make_dot_general("mxfp8"), **kw)
    _assert_same(qm(x), ref(x))  # proj mxfp8 (policy default), up bf16 (policy rule), down unmatched
    assert provider.get_unused_rules() == []

    conv = nnx.Conv(4, 32, (3, 3), rngs=nnx.Rngs(0))
    xc = jax.random.normal(jax.random.key(6), (1, 8, 8, 4), jnp.float32)
    qc = qwix.quantize_model(conv, Fp4Provider([Fp4Rule(recipe="mxfp8")]), xc)
    _assert_same(qc(xc), conv(xc))


def test_unblockable_raises_or_falls_back():
    class Odd(nnx.Module):
        def __init__(self):
            self.inner = nnx.Linear(24, D, rngs=nnx.Rngs(0))  # K = 24: no multiple of the MXFP8 block 32

        def __call__(self, x):
            return self.inner(x)

    x = jax.random.normal(jax.random.key(7), (32, 24), jnp.float32)
    qm = _quantized(Odd(), [Fp4Rule(recipe="mxfp8")], x)
    with pytest.raises(BlockingError, match=r"jax_fp4\.qwix dot_general.*K=24.*'inner'.*on_unblockable='bf16'"):
        qm(x)
    qb = _quantized(Odd(), [Fp4Rule(recipe="mxfp8", on_unblockable="bf16")], x)
    with pytest.warns(UnquantizedOpWarning, match="'inner' runs unquantized"):
        y = qb(x)
    _assert_same(y, Odd()(x))


def test_missing_nnx_rngs_is_a_clear_error():
    x = jax.random.normal(jax.random.key(8), (2, 16, D), jnp.float32)
    qm = _quantized(NnxBlock(D, nnx.Rngs(params=0, quantize=1)), [Fp4Rule(recipe="nvfp4")], x)
    qm(x)  # forward only: NVFP4's fprop rounds deterministically, no key needed
    with pytest.raises(ValueError, match=r"module 'proj'.*nvfp4.*set_rngs"):
        nnx.grad(lambda m: jnp.sum(m(x)))(qm)


def test_ragged_dot_group_offset_is_refused_with_strict():
    class Shard(nnx.Module):
        def __call__(self, x, w, sizes):
            return jax.lax.ragged_dot(x, w, sizes, group_offset=jnp.zeros((1,), jnp.int32))

    x, w, sizes = jnp.ones((32, D)), jnp.ones((2, D, D)), jnp.array([16, 16], jnp.int32)
    qm = qwix.quantize_model(Shard(), Fp4Provider([Fp4Rule(recipe="mxfp8")], strict=True), x, w, sizes,
                             skip_nnx_init=True)
    with pytest.raises(ValueError, match="ragged_dot of module '': group_offset"):
        qm(x, w, sizes)


def test_rule_validation():
    with pytest.raises(TypeError, match="recipe must be"):
        Fp4Rule(recipe=3)
    with pytest.raises(ValueError, match="unknown recipe"):
        Fp4Rule(recipe="nvfp5")
    with pytest.raises(ValueError, match="op_names"):
        Fp4Rule(recipe="mxfp8", op_names=("conv_general_dilated",))
    with pytest.raises(ValueError, match="weight_qtype"):
        Fp4Rule(recipe="mxfp8", weight_qtype=jnp.int8)
    with pytest.raises(ValueError, match="on_unblockable"):
        Fp4Rule(recipe="mxfp8", on_unblockable="fp32")
    with pytest.raises(TypeError, match="Fp4Rule"):
        Fp4Provider([qwix.QtRule(weight_qtype=jnp.int8)])
    assert Fp4Rule(recipe="MXFP8").recipe == by_name("mxfp8")


def test_aligned_ragged_dot_groups_of_any_size():
    """Unaligned group sizes and rows past their sum: forward equals jax_fp4.ragged_dot on the groups laid out
    padded by hand; the differentiated call has finite gradients (unpadded groups would give NaN dw)."""
    from jax_fp4.grouped_gemm import ragged_dot

    r = by_name("mxfp8")
    sizes = np.array([5, 0, 27, 9], np.int32)  # 41 of 48 rows
    x = jax.random.normal(jax.random.key(10), (48, D), jnp.float32)
    w = jax.random.normal(jax.random.key(11), (4, D, D), jnp.float32)
    padded = np.array([32, 0, 32, 32], np.int32)
    buf = np.zeros((96 + 32, D), np.float32)
    starts, pstarts = np.cumsum(sizes) - sizes, np.cumsum(padded) - padded
    for g in range(4):
        buf[pstarts[g]:pstarts[g] + sizes[g]] = np.asarray(x)[starts[g]:starts[g] + sizes[g]]
    want = np.zeros((48, D), np.float32)
    yb = np.asarray(ragged_dot(buf, w, padded, recipe=r))
    for g in range(4):
        want[starts[g]:starts[g] + sizes[g]] = yb[pstarts[g]:pstarts[g] + sizes[g]]
    got = jax.jit(lambda x, w, s: aligned_ragged_dot(x, w, s, recipe=r))(x, w, sizes)
    _assert_same(got, want)
    gx, gw = jax.grad(lambda x, w: jnp.sum(aligned_ragged_dot(x, w, jnp.asarray(sizes), recipe=r) ** 2),
                      argnums=(0, 1))(x, w)
    assert np.isfinite(np.asarray(gw)).all() and np.isfinite(np.asarray(gx)).all()
    assert not np.asarray(gx)[41:].any()  # rows past the groups get no gradient


def test_readme_example_runs():
    """The README's "Using jax_fp4 from qwix" example (at most 40 lines) trains: finite losses that go down, every
    rule used."""
    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    m = re.search(r"^### Using jax_fp4 from qwix\n.*?```python\n(.*?)```", readme, re.M | re.S)
    assert m, "README has no qwix example"
    code = m.group(1)
    assert len(code.splitlines()) <= 40
    ns: dict = {}
    exec(compile(code, "README.md (Using jax_fp4 from qwix)", "exec"), ns)
    losses = ns["losses"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
    assert ns["provider"].get_unused_rules() == []


def test_imports_without_qwix():
    check_optional_import("qwix", "qwix", also=("jax_fp4.flax",))

