"""Einsum edges: `make_dot_general` given to nnx.Einsum as its einsum op raises naming `make_einsum`; a contraction
over several axes keeps every block within the last contracted axis (BlockingError otherwise); Linen has a quantized
`jax_fp4.flax.linen.Einsum` with flax.linen.Einsum's parameters."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_fp4
from jax_fp4 import policy, recipes
from jax_fp4.blocking import BlockingError
from jax_fp4.flax import linen as flinen
from jax_fp4.flax import make_dot_general
from jax_fp4.flax.einsum import make_einsum

X = jax.random.normal(jax.random.key(0), (32, 64), jnp.float32)


def test_make_dot_general_as_an_einsum_op_names_make_einsum():
    layer = nnx.Einsum("bk,kn->bn", (64, 64), einsum_op=make_dot_general(recipes.MXFP8()), rngs=nnx.Rngs(0))
    for call in (lambda: layer(X), lambda: nnx.grad(lambda m: jnp.sum(m(X)))(layer)):
        with pytest.raises(TypeError, match=r"einsum_op=jax_fp4\.flax\.einsum\.make_einsum\('mxfp8'\)"):
            call()


def test_multi_axis_contraction_blocks_within_the_last_axis():
    es = make_einsum(recipes.MXFP8())
    h = jax.random.normal(jax.random.key(1), (32, 4, 8))
    w = jax.random.normal(jax.random.key(2), (4, 8, 64))
    with pytest.raises(BlockingError, match="last contracting axis, whose size 8 is not a multiple of 32"):
        es("thd,hdo->to", h, w)
    h, w = jnp.reshape(X, (32, 2, 32)), jax.random.normal(jax.random.key(2), (2, 32, 64))
    want = jax_fp4.dense(X, w.reshape(64, 64), recipe=recipes.MXFP8())  # K = heads x head_dim, flattened
    # the same quantized operands; jnp.einsum may order the GEMM's operands otherwise, so the float32 sums of the
    # 64 products may round in another order
    np.testing.assert_allclose(es("thd,hdo->to", h, w), want, rtol=64 * 2.0**-24, atol=1e-5)


def test_linen_einsum_matches_flax_and_make_einsum():
    ref = nn.Einsum((64, 2, 32), "bk,kho->bho")
    variables = ref.init(jax.random.key(0), X)
    bf16 = flinen.Einsum((64, 2, 32), "bk,kho->bho", recipe="bf16")
    assert jax.tree.map(jnp.shape, bf16.init(jax.random.key(0), X)) == jax.tree.map(jnp.shape, variables)
    np.testing.assert_array_equal(bf16.apply(variables, X), ref.apply(variables, X))
    mx = flinen.Einsum((64, 2, 32), "bk,kho->bho", recipe=recipes.MXFP8())
    p = variables["params"]
    want = make_einsum(recipes.MXFP8())("bk,kho->bho", X, p["kernel"]) + p["bias"]
    np.testing.assert_array_equal(mx.apply(variables, X), want)
    g = jax.grad(lambda v: jnp.sum(mx.apply(v, X) ** 2))(variables)
    assert np.isfinite(np.asarray(g["params"]["kernel"])).all()
    pol = flinen.Einsum((64, 2, 32), "bk,kho->bho", recipe=policy.uniform(recipes.MXFP8()))
    np.testing.assert_array_equal(pol.apply(variables, X), want)


def test_linen_einsum_blocking_error_names_the_layer():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return flinen.Einsum((64, 48), "bk,kn->bn", recipe=recipes.MXFP8(), name="proj")(x)

    with pytest.raises(BlockingError, match="of layer 'proj'"):
        jax.grad(lambda x: jnp.sum(Net().init_with_output(jax.random.key(0), x)[0]))(X)
