"""`ffi.reference_lowering_on_cpu()`: inside it the primitives lower to the jnp reference on the CPU (the oracle of
the GPU tests), outside it to the CPU extension's host handlers; no compiled executable crosses the boundary."""

import re

import jax
import jax.numpy as jnp
import pytest

import jax_fp4
from jax_fp4._src import ffi

pytestmark = pytest.mark.skipif(not ffi.HAS_CPU_KERNELS, reason=f"CPU extension not built: {ffi.cpu_import_error()}")


def _calls(fn, *args):
    return set(re.findall(r"custom_call\s*@(jf4_\w+)", jax.jit(fn).lower(*args).as_text()))


def test_reference_inside_handlers_outside():
    x = jax.random.normal(jax.random.key(0), (64, 128), jnp.bfloat16)

    def f(x):
        q = jax_fp4.quantize(x, jax_fp4.NVFP4(), scale_layout="swizzled")
        return jax_fp4.dequantize(q, jnp.float32)

    assert {"jf4_amax", "jf4_quantize", "jf4_dequantize"} <= _calls(f, x)
    kernel = jax.jit(f)(x)
    with ffi.reference_lowering_on_cpu():
        assert not _calls(f, x)
        with ffi.reference_lowering_on_cpu():  # nests
            assert not _calls(f, x)
        assert not _calls(f, x)
        reference = jax.jit(f)(x)
    assert {"jf4_quantize", "jf4_dequantize"} <= _calls(f, x)
    bits = jax.lax.bitcast_convert_type
    assert (bits(kernel, jnp.uint32) == bits(reference, jnp.uint32)).all()
