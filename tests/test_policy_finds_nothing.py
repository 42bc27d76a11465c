"""`jax_fp4.flax.policy.apply` / `describe` / `assignments` and `jax_fp4.flax.diagnostics.value_and_grad` never act
on nothing silently: a model whose only quantizable layers are drop-ins raises with "pass drop_in=True", one with
none raises too, and diagnostics name the layers they cannot instrument. What drop_in=True covers is what the module
docstring says: nnx.Linear, nnx.LinearGeneral, nnx.MultiHeadAttention's projections and nnx.Einsum, never the
router inside a MoEMLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_fp4 import policy, recipes
from jax_fp4.flax import diagnostics
from jax_fp4.flax import policy as flax_policy
from jax_fp4.flax.einsum import make_einsum
from jax_fp4.flax.moe import MoEMLP

POL = policy.uniform(recipes.MXFP8())


class _Plain(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(64, 64, rngs=rngs)
        self.out = nnx.Linear(64, 64, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.up(x)))


def test_plain_layers_without_drop_in_raise_with_the_fix():
    model = _Plain(nnx.Rngs(0))
    for call in (lambda: flax_policy.apply(POL, model), lambda: flax_policy.describe(POL, model),
                 lambda: flax_policy.assignments(POL, model)):
        with pytest.raises(ValueError, match="pass drop_in=True") as e:
            call()
        assert "'up'" in str(e.value) and "'out'" in str(e.value)
    out = flax_policy.apply(POL, model, drop_in=True)
    assert set(out) == {"up", "out"} and all(r.name == "mxfp8" for r in out.values())
    assert "mxfp8" in flax_policy.describe(POL, model, drop_in=True)


def test_a_model_without_quantizable_layers_raises():
    model = nnx.Sequential(nnx.LayerNorm(8, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="no quantizable layer"):
        flax_policy.apply(POL, model, drop_in=True)


class _Mixed(nnx.Module):
    def __init__(self, rngs):
        self.gen = nnx.LinearGeneral(64, (2, 32), rngs=rngs)
        self.ein = nnx.Einsum("bk,kn->bn", (64, 64), rngs=rngs)
        self.mha = nnx.MultiHeadAttention(2, 64, qkv_features=64, decode=False, rngs=rngs)
        self.moe = MoEMLP(64, 64, 2, recipe=recipes.BF16(), rngs=rngs)


def test_drop_in_covers_the_documented_layer_kinds_and_not_the_router():
    model = _Mixed(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (32, 64))
    before = model.ein(x)
    found = flax_policy.apply(POL, model, drop_in=True)
    assert set(found) == {"gen", "ein", "mha/query", "mha/key", "mha/value", "mha/out", "moe"}
    assert "moe/router" not in found
    np.testing.assert_array_equal(model.ein(x), make_einsum(recipes.MXFP8())("bk,kn->bn", x, model.ein.kernel[...]))
    assert not np.array_equal(model.ein(x), before)  # quantized now
    assert model.gen(x).shape == (32, 2, 32)


def test_diagnostics_of_a_drop_in_model_name_what_they_cannot_instrument():
    model = _Plain(nnx.Rngs(0))
    flax_policy.apply(POL, model, drop_in=True)
    loss = lambda m, x: jnp.mean(m(x) ** 2)  # noqa: E731
    with pytest.raises(ValueError, match="no jax_fp4.flax.nnx.Dense") as e:
        diagnostics.value_and_grad(loss)(model, jnp.ones((32, 64)))
    assert "'up'" in str(e.value) and "jax_fp4.diagnostics.dense" in str(e.value)


def test_apply_and_describe_walk_the_model_once(monkeypatch):
    model = _Plain(nnx.Rngs(0))
    walks = []
    real = nnx.iter_graph
    monkeypatch.setattr(nnx, "iter_graph", lambda node: walks.append(1) or real(node))
    flax_policy.apply(POL, model, drop_in=True)
    flax_policy.describe(POL, model, drop_in=True)
    assert len(walks) == 2


def test_describe_linen_of_a_model_the_policy_does_not_reach_raises():
    import flax.linen as nn

    class Plain(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(64)(x)

    with pytest.raises(ValueError, match="linen_dot_general"):
        flax_policy.describe_linen(POL, Plain(), jnp.ones((32, 64)))
