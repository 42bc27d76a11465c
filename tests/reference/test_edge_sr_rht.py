"""Stochastic rounding (Philox-4x32-10 stream + the SR rule) and the random Hadamard transform, by hand.

Expectations come from published known-answer vectors, from an independent pure-Python Philox written here, and
from rounding cases worked out in the comments; never from `jax_fp4.reference` itself.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_fp4
from jax_fp4.reference import rht, sr

from ._util import codes_of, p2, quantize

M32 = 0xFFFFFFFF
# Jitted (compiled once per shape): eager op-by-op dispatch of these bit-level routines is slow on CPU.
forward, inverse = jax.jit(rht.forward), jax.jit(rht.inverse)


def _philox_py(ctr, key):
    """Philox-4x32-10 (Salmon et al., SC'11; Random123 philox4x32round) on Python ints."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M32, (p0 >> 32) ^ c3 ^ k1, p0 & M32
    return c0, c1, c2, c3


# Random123 kat_vectors, philox4x32 with 10 rounds: (counter, key, output).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_philox_known_answers(ctr, key, want):
    assert _philox_py(ctr, key) == want  # the test's own Philox, validated first
    got = sr.philox4x32_10(tuple(jnp.array([c], jnp.uint32) for c in ctr), tuple(jnp.uint32(k) for k in key))
    assert tuple(int(np.asarray(w)[0]) for w in got) == want


def _stream_py(key, n):
    """The documented byte stream: element i takes byte i % 16 (little-endian within each 32-bit word) of the
    Philox output for counter (i // 16, 0, 0, 0), key = jax.random.bits(key, (2,), uint32)."""
    k0, k1 = (int(w) for w in np.asarray(jax.random.bits(key, (2,), jnp.uint32)))
    out = []
    for i in range(n):
        word = _philox_py((i // 16, 0, 0, 0), (k0, k1))[(i % 16) // 4]
        out.append((word >> (8 * (i % 4))) & 0xFF)
    return np.array(out)


def test_random_bytes_stream_layout():
    key = jax.random.key(1234)
    got = np.asarray(sr.random_bytes(key, (3, 40)))
    np.testing.assert_array_equal(got.reshape(-1), _stream_py(key, 120))


# A shard data[o : o + n] of a global array (offsets o, global dims N): its bytes are the global stream's at the
# shard's global indices (the sharding-exact stream of jf4_quantize). Rank 3 = the kernel's [P, R, C] stream words.
SHARDS = [  # (global shape, offsets, shard shape)
    ((3, 4, 48), (1, 2, 16), (2, 2, 32)),
    ((2, 3, 64), (0, 0, 0), (2, 3, 64)),   # the whole tensor: the unsharded stream
    ((4, 80), (3, 48), (1, 32)),
    ((64,), (32,), (16,)),
]


@pytest.mark.parametrize("gshape,off,shape", SHARDS, ids=str)
def test_random_bytes_shard_is_the_global_slice(gshape, off, shape):
    key = jax.random.key(99)
    k = sr.philox_key(key)
    glob = _stream_py(key, int(np.prod(gshape))).reshape(gshape)
    want = glob[tuple(slice(o, o + n) for o, n in zip(off, shape, strict=True))]
    got = jax.jit(sr.random_bytes_shard, static_argnums=(1, 3))(k, shape, jnp.asarray(off, jnp.int32), gshape)
    np.testing.assert_array_equal(np.asarray(got), want)
    words = sr.shard_words(k, off, gshape)  # uint32[2 + 2 d]: (k0, k1, offsets, global dims)
    assert words.dtype == jnp.uint32 and words.shape == (2 + 2 * len(shape),)
    np.testing.assert_array_equal(np.asarray(sr.random_bytes_from_words(words, shape)), want)


def test_random_bytes_shard_rejects_split_granules():
    k = jnp.zeros((2,), jnp.uint32)
    with pytest.raises(ValueError, match="multiple of 16"):
        sr.random_bytes_shard(k, (2, 24), (0, 0), (2, 48))
    with pytest.raises(ValueError, match="global last dim"):
        sr.random_bytes_shard(k, (2, 16), (0, 0), (2, 40))
    with pytest.raises(ValueError, match=re.escape("uint32[2] or uint32[6]")):
        sr.random_bytes_from_words(jnp.zeros((5,), jnp.uint32), (2, 16))


def test_sr_quantize_with_shard_words_is_the_global_slice(rng):
    """nvfp4.quantize_with_amax of a shard with its stream words == the global quantize's slice (same amax)."""
    from jax_fp4.reference import nvfp4
    fmt = jax_fp4.NVFP4(stochastic_rounding=True)
    y = jnp.asarray(rng.standard_normal((2, 32, 64)).astype(np.float32))
    amax = jnp.max(jnp.abs(y))
    k = sr.philox_key(jax.random.key(5))
    glob = jax.jit(lambda y: nvfp4.quantize_with_amax(y, fmt, amax, k).codes)(y)
    part = jax.jit(lambda y, w: nvfp4.quantize_with_amax(y, fmt, amax, w).codes)(
        y[1:, 16:, 32:], sr.shard_words(k, (1, 16, 32), (2, 32, 64)))
    np.testing.assert_array_equal(np.asarray(part), np.asarray(glob)[1:, 16:, 32:])


# (v, r, expected code). u = r/256; step = 0.5 (a < 2), 1 (a < 4), 2 (else); t = a + u*step; floor onto the grid
# {0, .5, 1, 1.5, 2, 3, 4, 6}, clamp 6, sign restored, NaN -> 0x7.
SR_CASES = [
    (0.3, 0, 0),        # t = 0.3 -> 0
    (0.3, 255, 1),      # t = 0.3 + 0.99609375*0.5 = 0.798 -> 0.5
    (0.3, 103, 1),      # t = 0.3 + 0.40234375*0.5 = 0.5012 -> 0.5
    (0.3, 102, 0),      # t = 0.3 + 0.3984375*0.5 = 0.4992 -> 0
    (0.75, 127, 1),     # t = 0.75 + 0.248 = 0.998 -> 0.5
    (0.75, 128, 2),     # t = 0.75 + 0.25 = 1.0 exactly -> 1
    (1.9, 255, 4),      # step 0.5: t = 2.398 -> 2
    (2.0, 255, 4),      # grid points never move: step 1, t = 2.996 -> 2
    (2.2, 200, 4),      # t = 2.2 + 0.78125 = 2.98125 -> 2
    (2.2, 205, 5),      # t = 2.2 + 0.80078 = 3.0008 -> 3
    (3.5, 128, 6),      # t = 3.5 + 0.5 = 4 -> 4
    (4.0, 255, 6),      # step 2: t = 4 + 1.992 = 5.99 -> 4
    (5.0, 127, 6),      # t = 5 + 0.9921875 = 5.992 -> 4
    (5.0, 128, 7),      # t = 5 + 1 = 6 -> 6
    (6.0, 255, 7),      # t = 7.99 -> clamp 6
    (100.0, 0, 7),      # clamp
    (-0.3, 255, 0x9),   # -0.5
    (-2.2, 205, 0xD),   # -3
    (-0.0, 0, 0x8),     # -0
    (-0.2, 0, 0x8),     # t = 0.2 -> 0, sign kept: -0
    (np.inf, 0, 0x7),
    (-np.inf, 0, 0xF),  # t = inf -> clamp 6, sign restored
    (np.nan, 0, 0x7),
    (-np.nan, 255, 0x7),
]


def test_sr_rule_cases():
    v = jnp.asarray(np.array([c[0] for c in SR_CASES], np.float32))
    r = jnp.asarray(np.array([c[1] for c in SR_CASES], np.uint32))
    got = np.asarray(jax.jit(sr.round_e2m1)(v, r)).tolist()
    assert got == [c[2] for c in SR_CASES], [(c, g) for c, g in zip(SR_CASES, got, strict=True) if c[2] != g]


def _sr_rule_np(v, r):
    """Independent numpy implementation of the SR rule (fp32 arithmetic) -> E2M1 codes."""
    grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
    a = np.abs(v).astype(np.float32)
    step = np.where(a < 2, np.float32(0.5), np.where(a < 4, np.float32(1), np.float32(2))).astype(np.float32)
    t = (a + (r.astype(np.float32) / np.float32(256)) * step).astype(np.float32)
    idx = np.searchsorted(grid, t, side="right") - 1
    return np.where(np.isnan(v), 7, np.minimum(idx, 7) | (np.signbit(v).astype(int) << 3))


@pytest.mark.parametrize("axis", [-1, 0])
def test_sr_quantize_end_to_end(rng, axis):
    """x[16, 32] with |x| <= 6 and a +-6 in every 1x16 block of both orientations: amax A = 6 -> S_enc = 2688/6
    = 448, s_b = e4m3(6 * fl(448 * r6)) = e4m3(448.00003) = 448, S_dec = fl(1/448), e_b = 1/fl(448 * fl(1/448))
    = 1/1 = 1. So the codes are the SR rule on x itself with the documented byte stream of the data (block axis
    last, row-major) — worked out here with the test's own Philox and rule."""
    x = rng.uniform(-6, 6, (16, 32)).astype(np.float32)
    for r in range(16):
        x[r, r], x[r, r + 16] = 6, -6
    key = jax.random.key(7)
    q = quantize(jnp.asarray(x), jax_fp4.NVFP4(stochastic_rounding=True), axis=axis, key=key)
    assert float(q.amax) == 6 and (codes_of(q.scale) == 0x7E).all()
    y = x if axis == -1 else x.T
    want = _sr_rule_np(y, _stream_py(key, y.size).reshape(y.shape))
    np.testing.assert_array_equal(codes_of(q.data), want)


# ---- random Hadamard transform ------------------------------------------------------------------------------
# docs/numerics.md s1: s = [+,+,+,-,+,-,-,-,-,-,-,+,-,+,-,-] (bitmask 0xD7E8), H = diag(s) @ H16 / 4.
SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float64)


def _h16():
    h = np.array([[1.0]])
    for _ in range(4):  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = np.block([[h, h], [h, -h]])
    return h


def test_hadamard_matrix():
    h = rht.hadamard_matrix()
    np.testing.assert_array_equal(h, np.diag(SIGNS) @ _h16() / 4)
    np.testing.assert_array_equal(h.astype(np.float64) @ h.T.astype(np.float64), np.eye(16))  # orthogonal
    assert [i for i in range(16) if (0xD7E8 >> i) & 1] == [i for i in range(16) if SIGNS[i] < 0]


def test_rht_forward_one_hot_rounds_to_bf16():
    """forward(c * e_i) = c * H[i, :] rounded to bf16, chunk by chunk. c = 1 + 2**-8 + 2**-10: c/4 = 2**-2 +
    2**-10 + 2**-12; bf16 keeps 8 significant bits, ulp(2**-2) = 2**-9, the remainder 2**-10 + 2**-12 exceeds
    the half-ulp 2**-10 -> rounds up to 2**-2 + 2**-9 = 0.251953125. Chunk 0 of every row stays zero."""
    c = np.float32(1 + 2.0**-8 + 2.0**-10)
    y = np.zeros((16, 32), np.float32)
    y[np.arange(16), 16 + np.arange(16)] = c
    out = np.asarray(forward(jnp.asarray(y)))
    np.testing.assert_array_equal(out[:, :16], 0)
    np.testing.assert_array_equal(out[:, 16:], np.diag(SIGNS) @ _h16() * 0.251953125)


def test_rht_forward_matches_bf16_rounded_product(rng):
    """Random chunks: forward(v) is v @ H (exact, float64) rounded once to bf16, except where the fp32 butterfly's
    own rounding meets a bf16 rounding boundary. Every butterfly value is at most S = sum|v| of the chunk, so the 4
    rounded adds and the exact * 1/4 leave the fp32 result within 4 * 2**-24 * S / 4 = 2**-24 * S of v @ H / 4; the
    bf16 results then differ by at most one bf16 ulp (<= 2**-7 of the larger magnitude) plus that error (x2 margin).
    The absolute term matters only under heavy cancellation (|v @ H| ~ 1e-6 with S ~ 10: about 2% of draws of 4096
    entries). Exact agreement is demanded for at least 99% of the entries."""
    v = rng.standard_normal((64, 64)).astype(np.float32)
    got = np.asarray(forward(jnp.asarray(v))).astype(np.float64)
    chunks = v.astype(np.float64).reshape(64, 4, 16)
    exact = (chunks @ (np.diag(SIGNS) @ _h16() / 4)).reshape(64, 64)
    want = exact.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    s = np.repeat(np.abs(chunks).sum(axis=-1), 16, axis=-1).reshape(64, 64)
    tol = np.maximum(np.abs(got), np.abs(want)) * 2.0**-7 + 2.0**-23 * s
    assert np.all(np.abs(got - want) <= tol)
    assert np.mean(got == want) > 0.99


def test_rht_inverse_recovers_within_bf16_rounding(rng):
    """y = forward(v) = v H + e with |e_j| <= 2**-8 |(v H)_j| (bf16 unit roundoff; fp32 butterfly error is ~2**-22
    relative, negligible). inverse(y) = y H^T = v + e H^T and H is orthogonal, so per 16-chunk
    ||inverse(forward(v)) - v||_2 = ||e||_2 <= 2**-8 ||v H||_2 = 2**-8 ||v||_2 (slack 1%)."""
    v = rng.standard_normal((32, 64)).astype(np.float32) * np.float32(3.0)
    back = np.asarray(inverse(forward(jnp.asarray(v)))).astype(np.float64)
    err = np.linalg.norm((back - v).reshape(32, 4, 16), axis=-1)
    norm = np.linalg.norm(v.astype(np.float64).reshape(32, 4, 16), axis=-1)
    assert np.all(err <= 2.0**-8 * norm * 1.01)
    assert np.any(err > 0)  # bf16 rounding did happen: inverse is not fed the exact product


def test_rht_flushes_subnormals():
    """docs/numerics.md section 1 (RHT) and rht.py: fp32 subnormal inputs are flushed to zero
    before the butterfly, so a chunk of subnormals transforms to exact zeros (IEEE would give ~2**-128 values)."""
    y = np.zeros((1, 16), np.float32)
    y[0, :4] = [p2(-127), -p2(-130), p2(-149), 3 * p2(-128)]
    np.testing.assert_array_equal(np.asarray(forward(jnp.asarray(y))), 0.0)


def test_rht_quantize_is_plain_quantize_of_the_transform(rng):
    """NVFP4(rht=True) = NVFP4() applied to forward(x) (amax taken after the transform), data and scales."""
    x = rng.standard_normal((16, 64)).astype(jnp.bfloat16)
    q = quantize(jnp.asarray(x), jax_fp4.NVFP4(rht=True))
    p = quantize(forward(jnp.asarray(x)), jax_fp4.NVFP4())
    np.testing.assert_array_equal(codes_of(q.data), codes_of(p.data))
    np.testing.assert_array_equal(codes_of(q.scale), codes_of(p.scale))
    # The amax is the transform's (it can coincide with max|x| for some draws, so compare with the transform's).
    assert float(q.amax) == float(p.amax) == float(np.max(np.abs(np.asarray(forward(jnp.asarray(x))))))
