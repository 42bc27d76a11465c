"""XLA:CPU runs a bfloat16 x bfloat16 -> float32 dot only inside its XNNPACK fusion; a dot left outside it reads back
"UNIMPLEMENTED: Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32". The gradient of a three-operand
einsum through the MXFP8 drop-in made XLA fold a transpose of an emulated product into the dot and crashed so, and
so did the same gradient under vmap (one batched dot); `jax_fp4._src.emulation.product.cpu_float32_operands` widens
the exact operands to float32 on the CPU (exact), so no such dot is emitted there."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fp4 import recipes
from jax_fp4.flax.einsum import make_einsum

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's program (GPU: cuBLAS GEMMs)")
OPS = [jax.random.normal(jax.random.key(i), (64, 64), jnp.float32) for i in range(3)]


def _loss(subscripts):
    es = make_einsum(recipes.MXFP8())
    return lambda a, b, c: jnp.sum(es(subscripts, a, b, c).astype(jnp.float32) ** 2)


@pytest.mark.parametrize("subscripts", ["ij,jk,kl->il", "ij,kj,lk->il"])
def test_three_operand_einsum_gradient_runs_on_the_cpu(subscripts):
    f = _loss(subscripts)
    grads = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(*OPS)
    for g, eager in zip(grads, jax.grad(f, argnums=(0, 1, 2))(*OPS), strict=True):
        assert g.shape == (64, 64) and np.isfinite(np.asarray(g)).all()
        np.testing.assert_array_equal(g, eager)


def test_three_operand_einsum_gradient_under_vmap():
    f = _loss("ij,jk,kl->il")
    g = jax.jit(jax.grad(lambda a: jnp.sum(jax.vmap(f, in_axes=(0, None, None))(a, *OPS[1:]))))(
        jnp.stack([OPS[0], OPS[2]]))
    single = jax.jit(jax.grad(f))
    np.testing.assert_array_equal(g[0], single(OPS[0], *OPS[1:]))
    np.testing.assert_array_equal(g[1], single(OPS[2], *OPS[1:]))


def test_no_bfloat16_dot_with_float32_result_on_the_cpu():
    """The compiled CPU program of a quantized einsum's gradient, vmapped, holds no bf16 x bf16 -> f32 dot."""
    import re

    f = _loss("ij,jk,kl->il")
    hlo = jax.jit(jax.grad(lambda a: jnp.sum(jax.vmap(f, in_axes=(0, None, None))(a, *OPS[1:])))).lower(
        jnp.stack([OPS[0]] * 2)).compile().as_text()
    dots = re.findall(r"= f32\[[^\]]*\][^=]*? dot\((bf16)?", hlo)
    assert dots and not any(dots), "a float32-result dot of bfloat16 operands reached XLA:CPU"
