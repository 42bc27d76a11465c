"""Stochastic rounding to E2M1 (docs/numerics.md section 1, TE PR #3281) and its random bits.

Random bits. The caller's JAX PRNG key is turned into a Philox-4x32-10 key: (k0, k1) = jax.random.bits(key, (2,),
uint32). The element at linear index i of the data (block axis last, row-major) takes byte (i % 16) of the
128-bit Philox output for counter (i // 16, 0, 0, 0): word (i % 16) // 4, bits 8 * (i % 4)... of that word, i.e.
bytes in little-endian order. A CUDA kernel generates exactly this stream from the two key words (a 2-word device
buffer, so no host sync), and the reference reproduces it here with 32-bit integer arithmetic. The counter word is
uint32: i // 16 wraps modulo 2**32 (tensors of 2**36 elements or more), identically in the kernel and here.

Sharded data. i is always the index in the *global* stored data, so a shard draws the bytes of its own elements and
sharded == unsharded bit for bit. A shard holding data[o_0 : o_0 + n_0, ..., o_{d-1} : o_{d-1} + n_{d-1}] of a global
array of shape (N_0, ..., N_{d-1}) is described by the stream words (uint32[2 + 2 d])

    (k0, k1, o_0, ..., o_{d-1}, N_0, ..., N_{d-1})

(`shard_words`), and `random_bytes_from_words` / `random_bytes_shard` return its bytes: element (j_0, ..., j_{d-1})
of the shard has i = (...((j_0 + o_0) N_1 + j_1 + o_1) N_2 + ...) N_{d-1} + j_{d-1} + o_{d-1}. The Philox granule
needs N_{d-1} % 16 == 0, n_{d-1} % 16 == 0 and o_{d-1} % 16 == 0 (a shard boundary along the block axis falls on a
16-block boundary, as the quantize sharding rule guarantees), so every 16-block is one whole Philox output. The
CUDA kernel takes the same words for its rank-3 [P, R, C] data (uint32[8]: k0, k1, p_off, r_off, c_off, P, R, C).

Rounding. a = |v| (v = x * e_b), u = r / 256, step(a) = 0.5 if a < 2, 1 if a < 4, else 2; t = a + u * step(a) (the
product u * step is exact, so an FMA gives the same t); t is rounded down onto the E2M1 grid and clamped to 6; the
sign of v is restored; NaN -> +6 (code 0x7).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

U32 = jnp.uint32
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85


def _mulhilo(a: int, b):
    """(hi, lo) 32-bit words of the 64-bit product of the constant a and uint32 array b."""
    lo = U32(a) * b
    a0, a1 = U32(a & 0xFFFF), U32(a >> 16)
    b0, b1 = b & U32(0xFFFF), b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    carry = ((p00 >> 16) + (p01 & U32(0xFFFF)) + (p10 & U32(0xFFFF))) >> 16
    hi = p11 + (p01 >> 16) + (p10 >> 16) + carry
    return hi, lo


def philox4x32_10(ctr, key):
    """Philox-4x32 with 10 rounds (Salmon et al. 2011, Random123). ctr: 4 uint32 arrays; key: 2 uint32 scalars."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = k0 + U32(_W0), k1 + U32(_W1)
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox_key(key):
    """Two uint32 Philox key words derived from a JAX PRNG key (typed or raw)."""
    return jax.random.bits(key, (2,), jnp.uint32)


def random_bytes(key, shape):
    """uint32 array of `shape` holding one random byte (0..255) per element, per the stream above."""
    return random_bytes_from_words(philox_key(key), shape)


def random_bytes_from_words(k, shape):
    """uint32 array of `shape`: one random byte (0..255) per element, per the stream above.

    k: uint32[2], the Philox key words (`philox_key`): the data is the whole tensor, i = its row-major index. Or
    uint32[2 + 2 * len(shape)], stream words of a shard (`shard_words`): see `random_bytes_shard`.
    Raises ValueError for any other length of k.
    """
    n_words, d = int(np.shape(k)[0]), len(shape)
    if n_words == 2 + 2 * d and d:
        return random_bytes_shard(k[:2], shape, k[2:2 + d], k[2 + d:])
    if n_words != 2:
        raise ValueError(f"random_bytes_from_words: k must be uint32[2] or uint32[{2 + 2 * d}] (stream words of a "
                         f"shard of rank {d}), got {jnp.result_type(k)}{list(np.shape(k))}")
    n = int(np.prod(shape))
    words_needed = -(-n // 16)
    ctr = jnp.arange(words_needed, dtype=U32)
    return _bytes(ctr, k).reshape(-1)[:n].reshape(shape)


def _bytes(ctr, k):
    """uint32 [*ctr.shape, 16]: the 16 bytes (little-endian words) of Philox(counter ctr) under key words k."""
    zero = jnp.zeros_like(ctr)
    w = jnp.stack(philox4x32_10((ctr, zero, zero, zero), (k[0], k[1])), axis=-1)  # [..., 4]
    b = (w[..., None] >> jnp.array([0, 8, 16, 24], U32)) & U32(0xFF)  # [..., 4, 4]
    return b.reshape(*ctr.shape, 16)


def shard_words(k, offsets, global_shape):
    """uint32[2 + 2 d]: the stream words of a shard (see the module docstring).

    k: uint32[2] Philox key words; offsets: d integers (traced or static), the shard's first index along each dim
    of the global data; global_shape: the global data's d dims (each < 2**32)."""
    parts = [jnp.asarray(k, U32).reshape(2)] + [jnp.asarray(o).astype(U32).reshape(1) for o in offsets]
    return jnp.concatenate(parts + [jnp.asarray(global_shape, U32).reshape(-1)])


def random_bytes_shard(k, shape, offsets, global_shape):
    """The random bytes (uint32 of `shape`) of the shard data[offsets : offsets + shape] of a global array.

    k: uint32[2] Philox key words; offsets: d uint32/int values (may be traced), the last a multiple of 16;
    global_shape: d dims (may be traced). Equal to random_bytes_from_words(k, global_shape)[offsets : offsets +
    shape] bit for bit. Raises ValueError unless shape[-1] % 16 == 0 (and a static global_shape[-1] % 16 == 0).
    """
    d = len(shape)
    if d == 0 or shape[-1] % 16:
        raise ValueError(f"random_bytes_shard: the shard's last dim must be a multiple of 16, got shape {shape}")
    last = global_shape[-1]
    if isinstance(last, (int, np.integer)) and last % 16:
        raise ValueError(f"random_bytes_shard: the global last dim must be a multiple of 16, got {global_shape}")
    off = [jnp.asarray(offsets[i]).astype(U32) for i in range(d)]
    tot = [jnp.asarray(global_shape[i]).astype(U32) for i in range(d)]
    bshape = (*shape[:-1], shape[-1] // 16)  # one Philox counter per 16-block
    ctr = jnp.zeros(bshape, U32)
    for i in range(d - 1):  # global row index, uint32 (wraps like the kernel's 32-bit counter)
        ctr = ctr * tot[i] + (jax.lax.broadcasted_iota(U32, bshape, i) + off[i])
    ctr = ctr * (tot[-1] >> 4) + (jax.lax.broadcasted_iota(U32, bshape, d - 1) + (off[-1] >> 4))
    return _bytes(ctr, k).reshape(shape)


_GRID_FLOOR = ((6.0, 7), (4.0, 6), (3.0, 5), (2.0, 4), (1.5, 3), (1.0, 2), (0.5, 1))


def round_e2m1(v, rbytes):
    """Stochastically round float32 v to E2M1 codes (uint32) with random bytes `rbytes` (uint32 0..255)."""
    a = jnp.abs(v)
    u = rbytes.astype(jnp.float32) * jnp.float32(1 / 256)
    step = jnp.where(a < 2, jnp.float32(0.5), jnp.where(a < 4, jnp.float32(1.0), jnp.float32(2.0)))
    t = a + u * step
    idx = jnp.zeros(v.shape, U32)
    for thr, code in reversed(_GRID_FLOOR):
        idx = jnp.where(t >= thr, U32(code), idx)
    sign = (jax.lax.bitcast_convert_type(v, U32) >> 31) << 3
    return jnp.where(jnp.isnan(v), U32(7), idx | sign)
