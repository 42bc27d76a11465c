"""`ragged_dot`'s group-size contract, kept by the value and the gradient alike: sizes >= 0 summing to <= T are
`jax.lax.ragged_dot`'s (BF16 gives its bits); otherwise a negative size counts as 0 and rows past T are cut off
(`jax_fp4.grouped_gemm.clip_group_sizes`), traced or concrete, with finite gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_fp4
from jax_fp4 import recipes
from jax_fp4.grouped_gemm import clip_group_sizes

T, K, N = 64, 32, 32
X = jax.random.normal(jax.random.key(0), (T, K), jnp.float32)
W = jax.random.normal(jax.random.key(1), (3, K, N), jnp.float32)
OUTSIDE = {"negative": ([32, -16, 32], [32, 0, 32]), "negative first": ([-32, 64, 32], [0, 64, 0]),
           "past T": ([32, 64, 32], [32, 32, 0])}


def test_clip_group_sizes():
    for sizes, want in OUTSIDE.values():
        assert np.asarray(clip_group_sizes(jnp.array(sizes, jnp.int32), T)).tolist() == want
    inside = jnp.array([16, 0, 32], jnp.int32)
    np.testing.assert_array_equal(clip_group_sizes(inside, T), inside)


def _value_and_grads(recipe, sizes):
    f = lambda x, w, g: jax_fp4.ragged_dot(x, w, g, recipe=recipe, key=jax.random.key(2))  # noqa: E731
    y = jax.jit(f)(X, W, sizes)
    dx, dw = jax.jit(jax.grad(lambda x, w, g: jnp.sum(f(x, w, g) ** 2), (0, 1)))(X, W, sizes)
    return [np.asarray(a) for a in (y, dx, dw)]


@pytest.mark.parametrize("case", list(OUTSIDE))
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "bf16"])
def test_value_and_gradient_follow_the_clipped_sizes(recipe, case):
    sizes, clipped = OUTSIDE[case]
    got = _value_and_grads(recipe, jnp.array(sizes, jnp.int32))  # traced sizes (jit arguments)
    want = _value_and_grads(recipe, jnp.array(clipped, jnp.int32))
    for a, b in zip(got, want, strict=True):
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a, b)
    if recipe == "bf16":  # lax.ragged_dot on the clipped sizes, value and gradient
        g = jnp.array(clipped, jnp.int32)
        ref = [lax.ragged_dot(X, W, g), *jax.grad(lambda x, w: jnp.sum(lax.ragged_dot(x, w, g) ** 2), (0, 1))(X, W)]
        for a, b in zip(got, ref, strict=True):
            np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6, atol=1e-5)


def test_bf16_is_lax_ragged_dot_in_its_domain():
    for sizes in ([16, 0, 32], [64, 0, 0], [0, 0, 0]):
        g = jnp.array(sizes, jnp.int32)
        np.testing.assert_array_equal(jax_fp4.ragged_dot(X, W, g, recipe=recipes.BF16()), lax.ragged_dot(X, W, g))
