"""Random Hadamard transform (RHT) of 16-chunks (docs/numerics.md section 1, TE `jax/quantize/hadamard.py`).

H = diag(s) @ H16 / 4 with H16 the Sylvester Hadamard matrix of order 16 and the fixed sign vector s given by the
bitmask 0xD7E8 (bit i set <=> s_i = -1). Each contiguous 16-chunk v along the block axis becomes v @ H.

Arithmetic order (docs/numerics.md section 1, RHT): signs applied first (exact), then the radix-2
butterfly in fp32 over strides 1, 2, 4, 8 (pairs (a, b) -> (a + b, a - b)), then * 0.25, then RNE to bfloat16.
Subnormal fp32 inputs and partial results are flushed to signed zero at every step, so the result is the same on
XLA:CPU (which flushes) and on CUDA (where the kernel uses .ftz adds). H is orthogonal, so the inverse is
v = y @ H.T: butterfly, * 0.25, then signs.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_fp4.reference import _f32

SIGN_MASK = 0xD7E8
CHUNK = 16
SIGNS = np.array([-1.0 if (SIGN_MASK >> i) & 1 else 1.0 for i in range(CHUNK)], np.float32)


def hadamard_matrix() -> np.ndarray:
    """H = diag(s) @ H16 / 4 as float32 [16, 16] (for tests and documentation)."""
    i = np.arange(CHUNK)
    h16 = np.where(np.bitwise_count(i[:, None] & i[None, :]) % 2, -1.0, 1.0)
    return (SIGNS[:, None] * h16 / 4).astype(np.float32)


def _butterfly(z):
    ftz = _f32.flush_subnormal
    for h in (1, 2, 4, 8):
        t = z.reshape(*z.shape[:-1], CHUNK // (2 * h), 2, h)
        a, b = t[..., 0, :], t[..., 1, :]
        z = jnp.stack([ftz(a + b), ftz(a - b)], axis=-2).reshape(z.shape)
    return z


def forward(y):
    """y: float array [..., n] with n % 16 == 0 -> float32 [..., n] holding bf16-rounded (v @ H) per 16-chunk."""
    y = _f32.flush_subnormal(y.astype(jnp.float32))
    z = y.reshape(*y.shape[:-1], y.shape[-1] // CHUNK, CHUNK) * jnp.asarray(SIGNS)
    z = _f32.flush_subnormal(_butterfly(z) * jnp.float32(0.25))
    z = _f32.from_bits(_f32.convert(z, _f32.BF16) << 16)
    return z.reshape(y.shape)


def inverse(y):
    """Inverse transform in fp32 (no bf16 rounding): float32 [..., n] -> float32 [..., n]."""
    y = _f32.flush_subnormal(y.astype(jnp.float32))
    z = y.reshape(*y.shape[:-1], y.shape[-1] // CHUNK, CHUNK)
    z = _f32.flush_subnormal(_butterfly(z) * jnp.float32(0.25)) * jnp.asarray(SIGNS)
    return z.reshape(y.shape)
