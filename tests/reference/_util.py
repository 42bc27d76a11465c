"""Small helpers shared by the reference tests (no expectations are computed here)."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # ReferenceOnlyWarning: no CUDA extension on a CPU machine
    import jax_fp4  # noqa: F401
from jax_fp4.reference import codes as _codes

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max


def codes_of(a) -> np.ndarray:
    """The bit codes (uint32) of a float4/float8 array, read through the bit pattern (NaN and -0 kept)."""
    return np.asarray(_codes.from_dtype(a))


def bits(a) -> np.ndarray:
    """uint32 bit patterns of float32 values."""
    return np.asarray(a, np.float32).view(np.uint32)


def from_bits(b) -> np.ndarray:
    return np.asarray(b, np.uint32).view(np.float32)


def p2(k: int) -> np.float32:
    """2**k as float32 (exact for -149 <= k <= 127, subnormals included)."""
    return np.float32(np.ldexp(1.0, k))


def up(v) -> np.float32:
    """The next float32 above v."""
    return np.nextafter(np.float32(v), np.float32(np.inf))


def dn(v) -> np.float32:
    """The next float32 below v."""
    return np.nextafter(np.float32(v), np.float32(-np.inf))


@functools.partial(jax.jit, static_argnames=("fmt", "axis", "scale_layout"))
def quantize(x, fmt, axis=-1, key=None, scale_layout="compact"):
    """jax_fp4.quantize under jax.jit (one compilation per shape and format: far cheaper on CPU than eager
    op-by-op dispatch; jit vs eager equality is tested in test_properties)."""
    return jax_fp4.quantize(x, fmt, axis=axis, key=key, scale_layout=scale_layout)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize(q, dtype=jnp.float32):
    return jax_fp4.dequantize(q, dtype)
