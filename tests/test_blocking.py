"""Shapes a recipe can block (`jax_fp4.blocking`): the rule agrees with the formats' own validation, errors name the
GEMM operand role, the layer's module path and the fixes, `flax.policy.describe` marks layers, and README's table is
the rule's."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jax_fp4
from jax_fp4 import blocking, policy, recipes
from jax_fp4.flax import linen as flinen
from jax_fp4.flax import make_dot_general
from jax_fp4.flax import nnx as fnnx
from jax_fp4.flax import policy as flax_policy

ROOT = Path(__file__).resolve().parents[1]
KEY = jax.random.key(0)
SIZES = (16, 32, 64, 96)


def _formats_refuse(recipe, M, K, N, differentiated, monkeypatch) -> bool:
    """Whether quantizing the operands itself (the formats' validation, without blocking.check) raises."""
    monkeypatch.setattr(blocking, "check", lambda *a, **k: None)
    x, w = jax.ShapeDtypeStruct((M, K), jnp.float32), jax.ShapeDtypeStruct((K, N), jnp.float32)
    f = lambda x, w: jax_fp4.dense(x, w, recipe=recipe, key=KEY).sum()  # noqa: E731
    try:
        jax.eval_shape(jax.grad(f, argnums=(0, 1)) if differentiated else f, x, w)
    except ValueError:
        return True
    finally:
        monkeypatch.undo()
    return False


@pytest.mark.parametrize("name", [n for n in recipes.RECIPES if n != "bf16"])
def test_needs_agree_with_the_formats(name, monkeypatch):
    r = recipes.by_name(name)
    for diff in (False, True):
        need = blocking.needs(r, differentiated=diff)
        for M, K, N in itertools.product(SIZES, SIZES, SIZES):
            fits = M % need["M"] == 0 and K % need["K"] == 0 and N % need["N"] == 0
            assert fits == (not blocking.unblocked(r, M, K, N, differentiated=diff)), (M, K, N, diff)
            if fits == _formats_refuse(r, M, K, N, diff, monkeypatch):  # the rule's verdict is the formats'
                pytest.fail(f"{name} differentiated={diff} M={M} K={K} N={N}: rule says fits={fits}")


def test_error_names_operand_role_dimension_and_fixes():
    x, w = jnp.ones((64, 64)), jnp.ones((64, 48))
    with pytest.raises(blocking.BlockingError) as e:
        jax.grad(lambda w: jax_fp4.dense(x, w, recipe="mxfp8").sum())(w)
    msg = str(e.value)
    assert "dgrad dy [M=64, N=48]" in msg and "dgrad w [K=64, N=48]" in msg and "N=48 is not a multiple of 32" in msg
    assert "wgrad x [" not in msg and "fprop w [" not in msg  # only the operands that fail
    assert "pad N to a multiple of 32" in msg and "nvfp4" in msg and "policy.exclude" in msg
    assert isinstance(e.value, ValueError) and "differentiated" in msg
    with pytest.raises(blocking.BlockingError, match=r"forward only.*fprop x \[M=64, K=40\].*K=40 is not a multiple"):
        jax_fp4.dense(jnp.ones((64, 40)), jnp.ones((40, 32)), recipe="mxfp8")
    with pytest.raises(blocking.BlockingError, match=r"wgrad x \[M=48, K=64\].*wgrad dy \[M=48, N=64\]"):
        jax.grad(lambda x: jax_fp4.dense(x, jnp.ones((64, 64)), recipe="nvfp4-fwd-mxfp8-bwd").sum())(
            jnp.ones((48, 64)))


class _Block(nnx.Module):
    def __init__(self, rngs):
        self.up = fnnx.Dense(64, 64, recipe="mxfp8", rngs=rngs)
        self.head = fnnx.LayerNormDense(64, 16, recipe="mxfp8", rngs=rngs)


class _Model(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([_Block(rngs) for _ in range(2)])
        self.proj = nnx.Linear(64, 16, dot_general=make_dot_general("mxfp8"), rngs=rngs)

    def __call__(this, x, head):  # (any name for self)
        h = this.blocks[1].up(x)
        return this.blocks[1].head(h) if head else this.proj(h)


def test_nnx_errors_name_the_module_path():
    model, x = _Model(nnx.Rngs(0)), jnp.ones((64, 64))
    for head, path in ((True, "blocks/1/head/dense"), (False, "proj")):
        with pytest.raises(blocking.BlockingError, match=re.escape(f"of layer {path!r}")) as e:
            nnx.eval_shape(lambda m, head=head: nnx.grad(lambda m: m(x, head).sum())(m), model)  # (raised when traced)
        assert f"policy.exclude({path!r})" in str(e.value)


class _Linen(nn.Module):
    @nn.compact
    def __call__(self, x, head):
        x = flinen.Dense(64, "mxfp8", name="up")(x)
        if head:
            return flinen.LayerNormDense(16, "mxfp8", name="head")(x)
        return nn.Dense(16, dot_general=make_dot_general("mxfp8"), name="proj")(x)


def test_linen_errors_name_the_module_path():
    x = jnp.ones((64, 64))
    for head, path in ((True, "head/dense"), (False, "proj")):
        params = jax.eval_shape(lambda k, x, head=head: _Linen().init(k, x, head), KEY, x)  # forward only: N = 16 fits
        with pytest.raises(blocking.BlockingError, match=re.escape(f"of layer {path!r}")):
            jax.eval_shape(jax.grad(lambda p, head=head: _Linen().apply(p, x, head).sum()), params)


def test_describe_marks_layers_that_cannot_be_blocked():
    class M(nnx.Module):
        def __init__(self, rngs):
            self.up = fnnx.Dense(64, 64, recipe="bf16", rngs=rngs)
            self.head = fnnx.Dense(64, 16, recipe="bf16", rngs=rngs)
            self.odd = fnnx.Dense(24, 64, recipe="bf16", rngs=rngs)
            self.lin = nnx.Linear(64, 48, rngs=rngs)

    rows = {ln.split()[0]: ln for ln in
            flax_policy.describe(policy.uniform(recipes.MXFP8()), M(nnx.Rngs(0)), drop_in=True).splitlines()[2:]}
    assert "!" not in rows["up"]
    assert "CANNOT BLOCK: mxfp8 needs N % 32 == 0 (N=16) in training" in rows["head"] and "nvfp4" in rows["head"]
    assert "N=48" in rows["lin"]
    assert "NO RECIPE CAN BLOCK K=24" in rows["odd"]


def test_readme_table_is_the_rule():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Shapes each recipe can block"):]
    rows = re.findall(r"^\| (`[^|]+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$", section, re.M)
    named = set()
    for cell, *nums in rows:
        for name in re.findall(r"`([^`]+)`", cell):
            r = recipes.by_name(name)
            t, i = blocking.needs(r, differentiated=True), blocking.needs(r, differentiated=False)
            assert [int(v) for v in nums] == [t["M"], t["K"], t["N"], i["M"], i["K"], i["N"]], name
            named.add(name)
    assert {"bf16", "mxfp8", "nvfp4", "nvfp4-fwd-mxfp8-bwd", "nvfp4-1x64"} <= named
