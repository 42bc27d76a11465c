"""`jf4_dequantize` ([P, R, C] view of a QuantizedArray) equals the public (reference) dequantize bit for bit.

On CPU this checks the primitive's geometry, scale-layout handling and reference lowering; on a GPU (gpu marker) the
same comparison runs the CUDA kernel against the CPU reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from jax_fp4._src.primitives.dequantize import dequantize_3d, dequantize_array

N, M = jax_fp4.NVFP4, jax_fp4.MXFP8
FORMATS = [N(), N(scaling_2d=True), N(rht=True), N(local_1x64=True), M(), M(element="e5m2")]


def _bits(a):
    a = np.asarray(a)
    return a.reshape(-1).view(np.uint8)


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
@pytest.mark.parametrize("axis,layout", [(-1, "compact"), (1, "swizzled")])
def test_primitive_equals_reference_dequantize(rng, fmt, axis, layout):
    x = jnp.asarray(rng.standard_normal((2, 64, 128)) * 3, jnp.bfloat16)
    if axis == 0:
        x = x.reshape(128, 128)
    q = jax_fp4.quantize(x, fmt, axis=axis, scale_layout=layout, key=jax.random.key(0))
    f = jax.jit(dequantize_array, static_argnums=1)
    for dt in (jnp.float32, jnp.bfloat16, jnp.float16):
        np.testing.assert_array_equal(_bits(f(q, dt)), _bits(jax_fp4.dequantize(q, dt)), err_msg=f"{dt}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
@pytest.mark.parametrize("axis,layout", [(-1, "compact"), (0, "swizzled"), (1, "compact")])
def test_kernel_equals_cpu_reference(rng, fmt, axis, layout):
    x = jnp.asarray(rng.standard_normal((2, 64, 128)) * 3, jnp.bfloat16)
    q = jax_fp4.quantize(x, fmt, axis=axis, scale_layout=layout, key=jax.random.key(0))
    f = jax.jit(dequantize_array, static_argnums=1)
    assert "jf4_dequantize" in f.lower(q, jnp.float32).as_text()
    cpu = jax.devices("cpu")[0]
    for dt in (jnp.float32, jnp.bfloat16, jnp.float16):
        got = f(q, dt)
        want = jax.jit(dequantize_array, static_argnums=1)(jax.device_put(q, cpu), dt)
        np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"{dt}")


def test_abstract_eval_errors():
    d = jnp.zeros((1, 4, 32), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_3d(d, jnp.zeros((1, 4, 2), jnp.float8_e8m0fnu), None, None, fmt=M(), out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="output dtype"):
        dequantize_3d(d, jnp.zeros((1, 4, 1), jnp.float8_e8m0fnu), None, None, fmt=M(), out_dtype=jnp.int8)
    with pytest.raises(ValueError, match="whole number of blocks"):
        dequantize_3d(d, jnp.zeros((1, 4, 1), jnp.float8_e8m0fnu), None, None, fmt=M(), out_dtype=jnp.float32,
                      mx_columnwise=True)
