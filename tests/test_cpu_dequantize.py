"""The CPU FFI handlers `jf4_dequantize`, `jf4_swizzle` and `jf4_unswizzle` (`_jax_fp4_cpu`) against the reference.

Each test binds the primitive on the CPU, where it lowers to the host handler (the HLO must hold the custom call),
and calls the reference lowering's own function (`reference_dequantize`, `reference_swizzle`,
`reference_unswizzle`) as the oracle; every output must have the same bits. Codes come from the CPU quantize and,
for the decoders' full range, from random bytes (every E2M1 / E4M3 / E5M2 / E8M0 code, NaN codes included).

Skipped where the CPU extension is not built.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _quantize_util import assert_leaf_bits, dtype_id, random_input

import jax_fp4
from jax_fp4 import MXFP8, NVFP4
from jax_fp4._src import ffi
from jax_fp4._src.primitives.dequantize import dequantize_operands, dequantize_p, reference_dequantize
from jax_fp4._src.primitives.swizzle import reference_swizzle, reference_unswizzle, swizzle_p, unswizzle_p
from jax_fp4.reference import codes

pytestmark = pytest.mark.skipif(not ffi.HAS_CPU_KERNELS, reason=f"CPU extension not built: {ffi.cpu_import_error()}")

FORMATS = [NVFP4(), NVFP4(rht=True), NVFP4(local_1x64=True), MXFP8(), MXFP8(element="e5m2")]
OUT = [jnp.float32, jnp.bfloat16, jnp.float16]


@functools.cache
def _jitted(items):
    """The jitted primitive bind and reference of one parameter set (cached: the random and the inf/nan inputs of a
    case share their compiles)."""
    params = dict(items)
    kernel = jax.jit(lambda *a: dequantize_p.bind(*a, **params))
    ref = jax.jit(lambda *a: reference_dequantize(*a, **{k: v for k, v in params.items() if k != "local"}))
    return kernel, ref


def _kernel_vs_reference(args, params, what):
    kernel, ref = _jitted(tuple(sorted(params.items())))
    if np.prod(args[0].shape):
        text = kernel.lower(*args).as_text()
        assert re.search(r"custom_call\s*@jf4_dequantize\b", text), "no jf4_dequantize custom call in the CPU HLO"
    assert_leaf_bits(kernel(*args), ref(*args), what)


@functools.cache
def _quantize(fmt, axis, layout):
    return jax.jit(lambda x, k: jax_fp4.quantize(x, fmt, axis=axis, key=k, scale_layout=layout))


@pytest.mark.parametrize("layout", ["compact", "swizzled"])
@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_dequantize(fmt, layout):
    """Rowwise (axis -1) and the other orientation (axis 0: NVFP4 transposed output, MXFP8 columnwise), every
    output dtype, inputs with the edge values and an all-NaN / inf mix."""
    rng = np.random.default_rng(21)
    x = random_input(rng, (192, 128), jnp.bfloat16)
    x_special = np.where(rng.random((192, 128)) < 0.5, np.inf, np.nan).astype(jnp.bfloat16)
    for axis in (-1, 0):
        for xi, name in ((x, "random"), (x_special, "inf/nan")):
            q = _quantize(fmt, axis, layout)(xi, jax.random.key(3))
            for dt in OUT:
                args, params = dequantize_operands(q, dt)
                _kernel_vs_reference(args, params, f"{fmt!r} axis {axis} {layout} {dtype_id(dt)} {name}")


@pytest.mark.parametrize("fmt", [NVFP4(), NVFP4(rht=True)], ids=repr)
def test_block_scales_only(fmt):
    q = _quantize(fmt, -1, "compact")(random_input(np.random.default_rng(4), (64, 96), jnp.float32), None)
    args, params = dequantize_operands(q, jnp.bfloat16)
    args = (args[0], args[1], jnp.zeros((0,), jnp.float32), args[3])  # no tensor amax: value(q) * s_b
    _kernel_vs_reference(args, params, f"{fmt!r} block scales only")


@pytest.mark.parametrize("fmt", [NVFP4(), NVFP4(local_1x64=True), MXFP8(), MXFP8(element="e5m2")], ids=repr)
def test_arbitrary_codes(fmt):
    """Every data and scale byte value (NaN scale codes included) and extreme tensor / window amaxes."""
    rng = np.random.default_rng(8)
    P, R, C = 2, 32, 128
    if isinstance(fmt, NVFP4):
        data = codes.to_dtype(jnp.asarray(rng.integers(0, 16, (P, R, C)), jnp.uint32), jnp.float4_e2m1fn)
        scale = jnp.asarray(rng.integers(0, 256, (P, R, C // 16), dtype=np.uint8)).view(jnp.float8_e4m3fn)
    else:
        data = jnp.asarray(rng.integers(0, 256, (P, R, C), dtype=np.uint8)).view(fmt.data_dtype)
        scale = jnp.asarray(rng.integers(0, 256, (P, R, C // 32), dtype=np.uint8)).view(jnp.float8_e8m0fnu)
    amax = jnp.asarray(np.array([0.0, 3e38], np.float32) if not fmt.local_1x64 else np.zeros(0, np.float32)) \
        if isinstance(fmt, NVFP4) else jnp.zeros((0,), jnp.float32)
    # (No subnormal window amax: XLA:CPU's DAZ inside the reference's fused `is_zero` reads one as 0, unlike the
    # kernels' IEEE compare.)
    wamax = jnp.asarray(np.resize(np.array([0.0, 1e-30, 1.0, np.inf, 3e38, 1e-12, np.nan], np.float32),
                                  (P, R, C // 64))) \
        if isinstance(fmt, NVFP4) and fmt.local_1x64 else jnp.zeros((0,), jnp.float32)
    for dt in OUT:
        params = dict(fmt=fmt, out_dtype=jnp.dtype(dt), scale_layout="compact", mx_columnwise=False,
                      transpose_out=False)
        _kernel_vs_reference((data, scale, amax, wamax), params, f"{fmt!r} arbitrary codes {dtype_id(dt)}")


@pytest.mark.parametrize("shape", [(3, 160, 5), (256, 8), (2, 0, 3)], ids=str)
def test_swizzle_unswizzle(shape):
    s = jnp.asarray(np.random.default_rng(1).integers(0, 256, shape, dtype=np.uint8)).view(jnp.float8_e4m3fn)
    sw = jax.jit(swizzle_p.bind)(s)
    if s.size:
        assert re.search(r"custom_call\s*@jf4_swizzle\b", jax.jit(swizzle_p.bind).lower(s).as_text())
    assert_leaf_bits(sw, jax.jit(reference_swizzle)(s), f"swizzle {shape}")
    rows, cols = shape[-2:]
    un = jax.jit(functools.partial(unswizzle_p.bind, rows=rows, cols=cols))
    ref_un = jax.jit(functools.partial(reference_unswizzle, rows=rows, cols=cols))
    noise = jnp.asarray(np.random.default_rng(2).integers(0, 256, sw.shape, dtype=np.uint8)).view(sw.dtype)
    for src in (sw, noise):  # unswizzle ignores the padding bytes
        assert_leaf_bits(un(src), ref_un(src), f"unswizzle {shape}")
