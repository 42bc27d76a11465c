"""The form in which `jax_fp4.dense` writes its emulated GEMMs over exact operands (`jax_fp4.dense._exact_gemm`).

Every backend: each GEMM role (fprop / dgrad / wgrad, with and without tensor scales and bias) gives the bits of
`exact_product` + bias in float32 + one cast (docs/numerics.md "GEMM emulation") on the CPU, where that is the
program; on a GPU the cuBLAS forms sum in cuBLAS's order, and the same comparison is made within the fp32
accumulation bound of `_gemm_util.gemm_bound`.
GPU: the optimized HLO of a Dense fwd+bwd runs its dots on cuBLAS (custom calls `__cublas$lt$matmul` /
`__cublas$gemm`) wherever the bf16 step's do, not in Triton GEMM fusions: all three GEMMs for the recipes whose
backward has no tensor scale, the fprop GEMM for nvfp4 (its tensor-scaled dgrad / wgrad stay where XLA puts them;
`_exact_gemm` says why).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _gemm_util import cast_bound, dot64, f64, gemm_bound
from _quantize_util import assert_same_bits

from jax_fp4 import dense, recipes
from jax_fp4._src.primitives.gemm import exact_product
from jax_fp4.dense import _DGRAD, _FPROP, _WGRAD, _exact_gemm
from jax_fp4.gemm import ExactOperand

M, K, N = 256, 512, 128


def _operand(rng, shape, scaled):
    """An ExactOperand with values exactly representable as E2M1 x E4M3 products (6 significant bits at most)."""
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    v = rng.choice(grid, size=shape) * rng.choice([-1.0, 1.0], size=shape) * 2.0 ** rng.integers(-6, 4, size=shape)
    t = jnp.float32(rng.uniform(0.01, 3.0)) if scaled else None
    return ExactOperand(jnp.asarray(v, jnp.bfloat16), t)


def _want(a, b, dn, out_dtype, bias):
    y = exact_product([a, b], dn)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)


CASES = [  # (role, dimension numbers, lhs shape, rhs shape, tensor-scaled, bias)
    ("fprop-unscaled", _FPROP, (M, K), (K, N), False, False),
    ("fprop-unscaled-bias", _FPROP, (M, K), (K, N), False, True),
    ("fprop-scaled", _FPROP, (M, K), (K, N), True, False),
    ("fprop-scaled-bias", _FPROP, (M, K), (K, N), True, True),
    ("dgrad-unscaled", _DGRAD, (M, N), (K, N), False, False),
    ("dgrad-scaled", _DGRAD, (M, N), (K, N), True, False),
    ("wgrad-unscaled", _WGRAD, (M, K), (M, N), False, False),
    ("wgrad-scaled", _WGRAD, (M, K), (M, N), True, False),
]


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("role,dn,sa,sb,scaled,with_bias", CASES, ids=[c[0] for c in CASES])
def test_exact_gemm_bits_equal_exact_product(rng, role, dn, sa, sb, scaled, with_bias, out_dtype):
    a, b = _operand(rng, sa, scaled), _operand(rng, sb, scaled)
    out_n = N if dn == _FPROP else (K if dn == _DGRAD else N)
    bias = jnp.asarray(rng.standard_normal(out_n), jnp.bfloat16) if with_bias else None
    got = jax.jit(lambda a, b, bias: _exact_gemm(a, b, dn, out_dtype, bias))(a, b, bias)
    assert got.dtype == jnp.dtype(out_dtype) and got.shape == (sa[dn[0][0][0] ^ 1], sb[dn[0][1][0] ^ 1])
    if jax.default_backend() == "cpu":
        want = jax.jit(lambda a, b, bias: _want(a, b, dn, out_dtype, bias))(a, b, bias)
        assert_same_bits(got, want, role)
    # Every backend: within the fp32 accumulation bound of the float64 product (_gemm_util's module docstring; the
    # two tensor scales are given float32 values here: one rounding for each multiplication).
    ref, absprod = dot64(f64(a.values), f64(b.values), dn)
    t = 1.0 if a.tensor_scale is None else float(a.tensor_scale) * float(b.tensor_scale)
    ref, absprod = ref * t, absprod * t
    if bias is not None:
        ref = ref + f64(bias)
    bound = cast_bound(ref, gemm_bound(absprod, sa[dn[0][0][0]], scale=2 if scaled else 0), out_dtype,
                       added_in_f32=bias is not None)
    assert np.all(np.abs(f64(got) - ref) <= bound), role


def _gemm_placement(hlo: str) -> tuple[int, int]:
    """(cuBLAS GEMM custom calls, Triton GEMM fusions) in an optimized HLO module's text."""
    cublas = len(re.findall(r'custom_call_target="__cublas\$(?:lt\$matmul|gemm)"', hlo))
    triton = len(re.findall(r'"kind":"__triton(?:_nested)?_gemm(?:_fusion)?"', hlo))
    return cublas, triton


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["nvfp4-fwd-mxfp8-bwd", "mxfp8", "nvfp4"])
def test_dense_gemms_run_on_cublas_like_bf16(name):
    """A Dense fwd+bwd at the medium preset's MLP-up shape (32768 tokens, 768 -> 3072), compiled for the GPU with the
    default XLA flags: where the bf16 step's three GEMMs are cuBLAS custom calls, so are the quantized step's, but
    nvfp4's tensor-scaled dgrad and wgrad (`_exact_gemm` says why), which XLA may give to Triton."""
    def hlo(recipe):
        key = jax.random.key(0) if recipe.needs_key else None

        def loss(x, w, g):  # the value is returned too, so that the fprop GEMM stays in the program
            return jnp.sum(dense(x, w, recipe=recipe, key=key).astype(jnp.float32) * g)

        x = jax.ShapeDtypeStruct((32768, 768), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((768, 3072), jnp.bfloat16)
        g = jax.ShapeDtypeStruct((32768, 3072), jnp.float32)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w, g).compile().as_text()

    base = _gemm_placement(hlo(recipes.BF16()))
    if base != (3, 0):
        pytest.skip(f"XLA puts the bf16 step's GEMMs on (cuBLAS, Triton) = {base} here")
    cublas, triton = _gemm_placement(hlo(recipes.by_name(name)))
    free = 2 if name == "nvfp4" else 0
    assert cublas >= 3 - free and cublas + triton == 3, (name, cublas, triton)
