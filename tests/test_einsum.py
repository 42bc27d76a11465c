"""The einsum drop-in: `jnp.einsum(..., _dot_general=make_dot_general(recipe))` and `make_einsum(recipe)` quantize
every contraction bit for bit as `jax_fp4.dot_general` with the same dimension numbers (forward and gradients), and
plug into `nnx.Einsum(einsum_op=...)` and Linen modules."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_fp4
from jax_fp4.flax import make_dot_general
from jax_fp4.flax.einsum import StreamEinsum, make_einsum

KX, KW, KEY = jax.random.split(jax.random.key(0), 3)
X = jax.random.normal(KX, (2, 32, 64), jnp.float32)
W = jax.random.normal(KW, (64, 4, 16), jnp.float32)
DN = (((2,), (0,)), ((), ()))  # "bsd,dhk->bshk"


def _eq(a, b):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "nvfp4-fwd-mxfp8-bwd"])
def test_einsum_is_the_dot_general_form(recipe):
    dg = make_dot_general(recipe, key=KEY)
    ref = jax_fp4.dot_general(X, W, DN, recipe=recipe, key=KEY)
    _eq(jnp.einsum("bsd,dhk->bshk", X, W, _dot_general=dg), ref)
    _eq(make_einsum(recipe)("bsd,dhk->bshk", X, W, key=KEY), ref)
    assert not np.array_equal(np.asarray(ref), np.asarray(jnp.einsum("bsd,dhk->bshk", X, W)))  # quantized

    def loss(f):
        return lambda x, w: (f(x, w) * jnp.cos(f(x, w))).sum()

    g_ein = jax.grad(loss(lambda x, w: make_einsum(recipe)("bsd,dhk->bshk", x, w, key=KEY)), argnums=(0, 1))(X, W)
    g_dg = jax.grad(loss(lambda x, w: jax_fp4.dot_general(x, w, DN, recipe=recipe, key=KEY)), argnums=(0, 1))(X, W)
    for a, b in zip(g_ein, g_dg, strict=True):
        _eq(a, b)


def test_transposed_subscripts_and_bf16():
    """Output and operand transposes happen around the quantized contraction; BF16 is plain jnp.einsum."""
    y = make_einsum("mxfp8")("dhk,bsd->hbsk", W, X)
    ref = jnp.transpose(jax_fp4.dot_general(X, W, DN, recipe="mxfp8"), (2, 0, 1, 3))
    _eq(y, ref)
    _eq(make_einsum("bf16")("bsd,dhk->bshk", X, W), jnp.einsum("bsd,dhk->bshk", X, W))


def test_nnx_einsum_with_a_model_owned_stream():
    class M(nnx.Module):
        def __init__(self, rngs):
            self.q = nnx.RngStream(jax.random.key(1), tag="quantize")
            self.proj = nnx.Einsum("bsd,dhk->bshk", (64, 4, 16), (4, 16), einsum_op=make_einsum("nvfp4", key=self.q),
                                   rngs=rngs)

        def __call__(self, x):
            return self.proj(x)

    m = M(nnx.Rngs(0))
    assert isinstance(m.proj.einsum_op, StreamEinsum)
    y = m(X)  # forward only: the stream is left alone
    assert int(m.q.count[...]) == 0 and y.shape == (2, 32, 4, 16)
    grads = nnx.jit(nnx.grad(lambda m: m(X).sum()))(m)
    assert int(m.q.count[...]) == 1 and grads["proj"]["kernel"][...].shape == (64, 4, 16)


def test_linen_module_with_make_einsum():
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.lecun_normal(), (64, 4, 16))
            return make_einsum("nvfp4")("bsd,dhk->bshk", x, w)

    p = M().init(jax.random.key(0), X)
    g = jax.grad(lambda p: M().apply(p, X, rngs={"quantize": jax.random.key(3)}).sum())(p)
    assert g["params"]["w"].shape == (64, 4, 16)
    with pytest.raises(ValueError, match="key"):
        jax.grad(lambda p: M().apply(p, X).sum())(p)  # an SR recipe differentiated without a key


def test_make_einsum_refuses_a_bad_key_source():
    with pytest.raises(TypeError, match="make_einsum: key"):
        make_einsum("mxfp8", key=3)
