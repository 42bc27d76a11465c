"""The reference compiled by XLA:GPU gives the bits XLA:CPU gives (the package's 'CPU results are GPU bits' claim).

XLA:CPU flushes fp32 subnormals and XLA:GPU does not; the reference avoids hardware arithmetic wherever a
subnormal can appear, so both must agree bit for bit, edge values included. This calls `jax_fp4.reference`
directly (`jax_fp4.quantize` runs the CUDA kernels on a GPU; tests/test_quantize_kernels.py covers those).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from jax_fp4.reference import codes

FORMATS = [
    jax_fp4.NVFP4(),
    jax_fp4.NVFP4(scaling_2d=True),
    jax_fp4.NVFP4(rht=True),
    jax_fp4.NVFP4(stochastic_rounding=True),
    jax_fp4.NVFP4(local_1x64=True),
    jax_fp4.MXFP8(),
    jax_fp4.MXFP8(element="e5m2"),
]

EDGE = np.array(
    [0.0, -0.0, 1e-40, -3e-39, 1.17e-38, 2.5e-36, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 448.0, 57344.0,
     np.inf, -np.inf, np.nan, 3.0e38, -1e-45, 7.0e-36],
    np.float32,
)


def _input(shape, dtype, seed, scale_exp):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(2.0**scale_exp)
    flat = x.reshape(-1)
    pos = rng.choice(flat.size, size=min(flat.size, 3 * EDGE.size), replace=False)
    flat[pos] = np.resize(EDGE, pos.size)
    return jnp.asarray(x.reshape(shape), dtype)


def _bits(a):
    a = np.asarray(a)
    if a.dtype.itemsize == 1 or a.dtype.name.startswith("float4"):
        return np.asarray(jax.device_get(codes.from_dtype(jnp.asarray(a))))
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def _on(device, fn, *args):
    args = jax.device_put(args, device)
    return jax.device_get(jax.jit(fn)(*args))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
@pytest.mark.parametrize("dtype,scale_exp", [(jnp.float32, -120), (jnp.bfloat16, 0), (jnp.bfloat16, 100)])
@pytest.mark.parametrize("axis", [-1, 0])
def test_reference_gpu_equals_cpu(fmt, dtype, scale_exp, axis):
    x = _input((128, 192), dtype, seed=scale_exp & 0xFF, scale_exp=scale_exp)
    key = jax.random.key(7)
    cpu, gpu = jax.devices("cpu")[0], jax.devices("gpu")[0]

    def q(x, key):
        return jax_fp4.reference.quantize(x, fmt, axis=axis, key=key)

    qc, qg = _on(cpu, q, x, key), _on(gpu, q, x, key)
    for name in ("data", "scale", "amax", "window_amax"):
        a, b = getattr(qc, name), getattr(qg, name)
        if a is None:
            assert b is None
            continue
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{name} differs CPU vs GPU")
    ax = fmt.normalize_axis(x.shape, axis)
    for out in (jnp.float32, jnp.bfloat16, jnp.float16):
        def dq(q, out=out):
            return jax_fp4.reference.dequantize(*q, fmt, ax, out)

        dc, dg = _on(cpu, dq, qc), _on(gpu, dq, qc)
        np.testing.assert_array_equal(_bits(dc), _bits(dg), err_msg=f"dequantize to {out} differs CPU vs GPU")
