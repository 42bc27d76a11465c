"""Stochastic-rounding keys under NNX transforms: model-owned rng streams (the layers' own and a drop-in's key
source) work under nnx.grad / nnx.jit / nnx.scan, forward-only calls leave them alone, and a model closed over by
plain jax.jit runs inference."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_fp4
from jax_fp4 import recipes
from jax_fp4.flax import linen as flinen
from jax_fp4.flax import make_dot_general
from jax_fp4.flax import nnx as fnnx
from jax_fp4.flax.dot_general import StreamDotGeneral
from jax_fp4.flax.nnx_layers import differentiated

X = jax.random.normal(jax.random.key(0), (32, 32), jnp.float32)
C = jax.random.normal(jax.random.key(1), (32, 32), jnp.float32)  # a cotangent whose rounding shows the key


class DropIn(nnx.Module):
    """nnx.Linear with a drop-in dot_general whose keys come from a stream the model owns."""

    def __init__(self, recipe, rngs):
        self.q = nnx.RngStream(jax.random.key(3), tag="quantize")
        self.lin = nnx.Linear(32, 32, dot_general=make_dot_general(recipe, key=self.q), rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


def _count(stream):
    return int(stream.count[...])


def test_drop_in_stream_under_nnx_transforms():
    m = DropIn(recipes.NVFP4(), nnx.Rngs(0))
    assert isinstance(m.lin.dot_general, StreamDotGeneral) and m.lin.dot_general.source is m.q
    loss = lambda m: (m(X) * C).sum()  # noqa: E731
    g1 = nnx.grad(loss)(m)
    assert _count(m.q) == 1
    g2 = nnx.jit(nnx.grad(loss))(m)
    assert _count(m.q) == 2
    k1, k2 = g1["lin"]["kernel"][...], g2["lin"]["kernel"][...]
    assert k1.shape == (32, 32) and np.isfinite(np.asarray(k1)).all() and not np.array_equal(k1, k2)  # fresh keys

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def steps(m, x):
        return m, nnx.grad(lambda m: (m(x) * C).sum())(m)["lin"]["kernel"][...].sum()

    _, out = steps(m, jnp.stack([X, X, X]))
    assert _count(m.q) == 5 and len(set(np.asarray(out).tolist())) == 3  # one fresh key per step


def test_forward_only_calls_leave_the_stream_alone():
    """Eager, nnx.jit-free and plain jax.jit inference of an SR recipe whose forward is deterministic: no draw
    (jax.jit of a closed-over model could not advance it anyway)."""
    for model, stream in ((lambda: DropIn(recipes.NVFP4(), nnx.Rngs(0)), lambda m: m.q),
                          (lambda: fnnx.Dense(32, 32, recipe=recipes.NVFP4(), rngs=nnx.Rngs(0)), lambda m: m.rngs)):
        m = model()
        c0 = _count(stream(m))
        y_eager = m(X)
        y_jit = jax.jit(lambda x, m=m: m(x))(X)
        assert _count(stream(m)) == c0
        np.testing.assert_array_equal(np.asarray(y_eager), np.asarray(y_jit))
        with pytest.raises(ValueError, match="nnx.jit / nnx.grad / nnx.scan"):  # closed over, differentiated
            jax.jit(jax.grad(lambda x, m=m: m(x).sum()))(X)


def test_layer_stream_under_nnx_grad_jit_scan():
    m = fnnx.Dense(32, 32, recipe=recipes.NVFP4(), rngs=nnx.Rngs(0))
    c0 = _count(m.rngs)
    nnx.jit(nnx.grad(lambda m: m(X).sum()))(m)
    assert _count(m.rngs) == c0 + 1

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def steps(m, x):
        return m, nnx.grad(lambda m: m(x).sum())(m)["kernel"][...].sum()

    steps(m, jnp.stack([X, X]))
    assert _count(m.rngs) == c0 + 3


def test_differentiated_detection():
    assert differentiated(X) is False
    seen = []
    jax.grad(lambda x: (seen.append(differentiated(x)), x.sum())[1])(X)
    jax.jit(lambda x: (seen.append(differentiated(x)), x)[1])(X)
    jax.vmap(jax.grad(lambda x: (seen.append(differentiated(x)), x.sum())[1]))(X)
    assert seen == [True, None, True]


def test_linen_without_a_key_names_apply_rngs():
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return flinen.Dense(32, "nvfp4", name="proj")(x)

    p = M().init(jax.random.key(0), X)
    M().apply(p, X)  # forward only: no key needed
    with pytest.raises(ValueError, match=r"'proj'.*rngs=\{'quantize': key\}"):
        jax.grad(lambda p: M().apply(p, X).sum())(p)
    jax.grad(lambda p: M().apply(p, X, rngs={"quantize": jax.random.key(1)}).sum())(p)


def test_callable_key_source_is_documented_as_per_trace():
    doc = jax_fp4.flax.make_dot_general.__doc__
    assert "traced" in doc and "once per compilation" in doc
