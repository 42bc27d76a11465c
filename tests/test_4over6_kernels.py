"""The CUDA kernels on NVFP4 4over6 operands (`NVFP4(use_4over6=True)`) against the bit-exact reference.

Same method as tests/test_quantize_kernels.py (whose helpers this reuses): the jitted function runs on the GPU (its
HLO must hold the custom calls) and on the CPU device (the reference lowering), and every output bit is compared:
quantize in both orientations with compact and swizzled scales, the single-pass rowwise + columnwise kernel with
exact operands and MXFP8 / plain NVFP4 partners, inputs scaled into the subnormal and near-overflow ranges, and the
dequantize of 4over6 tensors (tensor scale on the E4M3 bound 256). Marked `gpu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _quantize_util import dtype_id, random_input
from test_quantize_kernels import _calls_for, gpu_vs_cpu

import jax_fp4
from jax_fp4 import MXFP8, NVFP4

pytestmark = pytest.mark.gpu

FORMATS_4OVER6 = [
    NVFP4(use_4over6=True),
    NVFP4(use_4over6=True, scaling_2d=True),
    NVFP4(use_4over6=True, err_mode_4over6="MSE"),
    NVFP4(use_4over6=True, e4m3_max=448, scaling_2d=True),
]
SHAPES = [((256, 192), jnp.bfloat16), ((80, 48), jnp.float32), ((320, 64), jnp.float16), ((3, 64, 96), jnp.bfloat16)]


def _cases():
    return [pytest.param(f, s, d, id=f"{f!r}-{s}-{dtype_id(d)}") for i, f in enumerate(FORMATS_4OVER6)
            for j, (s, d) in enumerate(SHAPES) if (i + j) % 2 == 0 or s == (256, 192)]


@pytest.mark.parametrize("fmt,shape,dtype", _cases())
def test_quantize_4over6_matches_reference(rng, fmt, shape, dtype):
    x = random_input(rng, shape, dtype)
    axes = (-1, 0) if len(shape) == 2 else (1, -1)

    def f(x):
        return {f"axis={a}": {lay: jax_fp4.quantize(x, fmt, axis=a, scale_layout=lay)
                              for lay in ("compact", "swizzled")} for a in axes}

    gpu_vs_cpu(f, x, present=_calls_for(fmt), what=f"{fmt!r} {dtype_id(dtype)}{shape}")


@pytest.mark.parametrize("fmt", FORMATS_4OVER6[:2], ids=repr)
@pytest.mark.parametrize("scale_exp,dtype", [(-120, jnp.float32), (100, jnp.bfloat16)], ids=["2^-120", "2^100"])
def test_quantize_4over6_scaled_inputs(rng, fmt, scale_exp, dtype):
    x = random_input(rng, (128, 128), dtype, scale_exp=scale_exp)
    gpu_vs_cpu(lambda x: (jax_fp4.quantize(x, fmt), jax_fp4.quantize(x, fmt, axis=0)), x, present=_calls_for(fmt))


PAIRS_4OVER6 = [
    (NVFP4(use_4over6=True), NVFP4(use_4over6=True)),
    (NVFP4(use_4over6=True), MXFP8()),  # the nvfp4-fwd-mxfp8-bwd-4over6 activation
    (NVFP4(use_4over6=True, scaling_2d=True), NVFP4(scaling_2d=True)),  # the nvfp4-4over6 weight
    (NVFP4(use_4over6=True, scaling_2d=True), NVFP4(use_4over6=True, scaling_2d=True)),
]


@pytest.mark.parametrize("pair", PAIRS_4OVER6, ids=lambda p: f"{p[0]!r}+{p[1]!r}")
@pytest.mark.parametrize("exact", [(False, False), (True, True)], ids=["codes", "exact"])
def test_rowwise_columnwise_4over6(rng, pair, exact):
    row_fmt, col_fmt = pair
    x = random_input(rng, (192, 128), jnp.bfloat16)

    def f(x):
        return jax_fp4.quantize_rowwise_columnwise(x, row_fmt, col_fmt, exact=exact)

    gpu_vs_cpu(f, x, present=_calls_for(row_fmt, col_fmt), what=f"{pair} exact={exact}")


@pytest.mark.parametrize("fmt", FORMATS_4OVER6[:2], ids=repr)
def test_dequantize_4over6(rng, fmt):
    x = random_input(rng, (128, 96), jnp.float32)
    q = jax.jit(lambda x: (jax_fp4.quantize(x, fmt), jax_fp4.quantize(x, fmt, axis=0)))(x)
    gpu_vs_cpu(lambda q: [jax_fp4.dequantize(a, d) for a in q for d in (jnp.float32, jnp.bfloat16)], q,
               present=("jf4_dequantize",))


@pytest.mark.parametrize("sizes", [(32, 48, 16), (24, 40, 32)], ids=["aligned", "misaligned"])
def test_grouped_4over6(rng, sizes):
    """jf4_grouped_quantize (tile and generic paths) and jf4_grouped_dequantize on 4over6 groups; the sizes are
    traced, so misaligned groups reach the kernels (their columnwise outputs are poisoned alike)."""
    x = random_input(rng, (96, 48), jnp.bfloat16)
    row, col = NVFP4(use_4over6=True), NVFP4(use_4over6=True, err_mode_4over6="MSE")

    def f(x, s):
        qr, qc, _ = jax_fp4.grouped_quantize_rowwise_columnwise(x, s, row, col)
        return qr, qc, jax_fp4.grouped_dequantize(qr, jnp.float32)

    gpu_vs_cpu(f, x, jnp.asarray(sizes, jnp.int32), present=("jf4_grouped_quantize", "jf4_grouped_dequantize"))
