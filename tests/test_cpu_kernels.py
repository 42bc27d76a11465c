"""The CPU FFI handlers (`_jax_fp4_cpu`: `jf4_quantize`, `jf4_amax`, `jf4_rht_amax`) against the bit-exact reference.

Each test runs the primitive on the CPU, where it lowers to the host handler (its HLO must hold the custom call, so a
test cannot silently pass on the reference), and the reference functions themselves (`reference_outputs`,
`reference.amax`, `reference.rht`) as the oracle, and asserts equal bits for every output. dbias is an fp32 sum whose
order is the handler's, so it is checked against the float64 column sums within the fp32 summation bound.

Skipped where the CPU extension is not built (a source checkout imported without installing).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _quantize_util import (
    EDGE,
    PAIRS,
    assert_dbias_partials_close,
    assert_same_bits,
    dtype_id,
    pair_id,
    random_input,
    special_inputs,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_fp4 import MXFP8, NVFP4
from jax_fp4._src import ffi
from jax_fp4._src.primitives.amax import tensor_amax
from jax_fp4._src.primitives.quantize import OUTPUT_NAMES, quantize_3d, reference_outputs
from jax_fp4._src.primitives.rht_amax import rht_amax
from jax_fp4.reference import rht, sr
from jax_fp4.reference.amax import amax as reference_amax

pytestmark = pytest.mark.skipif(not ffi.HAS_CPU_KERNELS, reason=f"CPU extension not built: {ffi.cpu_import_error()}")

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
KEY_WORDS = np.array([0x12345678, 0x9ABCDEF0], np.uint32)


def _has_call(fn, args, name):
    text = jax.jit(fn).lower(*args).as_text()
    assert re.search(rf"custom_call\s*@{name}\b", text), f"no {name} custom call in the CPU HLO"


@functools.cache
def _pair_fns(row_fmt, col_fmt, scale_layout, dbias, exact):
    p = dict(row_fmt=row_fmt, col_fmt=col_fmt, scale_layout=scale_layout, dbias=dbias, exact=exact)
    kernel = jax.jit(lambda *a: quantize_3d(*a, **p))
    ref = jax.jit(lambda *a: dict(zip(OUTPUT_NAMES, reference_outputs(*a, **p), strict=True)))
    return kernel, ref


def _amaxes(x3, row_fmt, col_fmt):
    """Per-p tensor amax of each orientation (post-RHT for RHT formats), from the reference."""
    def one(fmt, col):
        if isinstance(fmt, NVFP4) and fmt.rht:
            y = jnp.swapaxes(x3, 1, 2) if col else x3
            return reference_amax(rht.forward(y), axis=(1, 2))
        return reference_amax(x3, axis=(1, 2))
    return one(row_fmt, False), one(col_fmt, True)


def check_quantize(x3, row_fmt, col_fmt, scale_layout="compact", dbias=False, exact=(False, False), key_row=None,
                   key_col=None, what=""):
    x3 = jnp.asarray(x3)
    ar, ac = _amaxes(x3, row_fmt, col_fmt)
    kr = jnp.asarray(KEY_WORDS if key_row is None else key_row, jnp.uint32)
    kc = jnp.asarray(KEY_WORDS[::-1].copy() if key_col is None else key_col, jnp.uint32)
    kernel, ref = _pair_fns(row_fmt, col_fmt, scale_layout, dbias, exact)
    args = (x3, ar, ac, kr, kc)
    if x3.size:
        _has_call(kernel, args, "jf4_quantize")
    got, want = kernel(*args), ref(*args)
    assert_same_bits(got, want, what, skip=("dbias",))
    if dbias:
        assert_dbias_partials_close(got["dbias"], np.asarray(x3.astype(jnp.float32)), what=f"{what} dbias")


def _exact_ok(fmt):
    return fmt is not None and not (isinstance(fmt, NVFP4) and fmt.local_1x64)


# ---- every rowwise/columnwise pairing, both scale layouts, exact operands, dbias, special inputs ---------------------
@pytest.mark.parametrize("scale_layout", ["compact", "swizzled"])
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_pairs(pair, scale_layout):
    row_fmt, col_fmt = pair
    i = PAIRS.index(pair)
    dt = DTYPES[i % 3]
    rng = np.random.default_rng(100 + i)
    shape = (2, 64, 128)
    inputs = {"random": random_input(rng, shape, dt), **special_inputs(rng, shape[1:], dt)}
    for name, x in inputs.items():
        x3 = x if x.ndim == 3 else np.stack([x, x[::-1]])
        check_quantize(x3, row_fmt, col_fmt, scale_layout, dbias=col_fmt is not None,
                       what=f"{pair_id(pair)}-{scale_layout}-{dtype_id(dt)}-{name}")


@pytest.mark.parametrize("pair", [p for p in PAIRS if _exact_ok(p[0]) or _exact_ok(p[1])], ids=pair_id)
def test_exact_operands(pair):
    row_fmt, col_fmt = pair
    exact = (_exact_ok(row_fmt), _exact_ok(col_fmt))
    rng = np.random.default_rng(7)
    x = random_input(rng, (1, 128, 64), jnp.bfloat16)
    check_quantize(x, row_fmt, col_fmt, "compact", exact=exact, what=f"exact {pair_id(pair)}")


# ---- shapes: partial 16-row bands, P > 1, blocks not multiples of 64, empty ------------------------------------------
@pytest.mark.parametrize(
    "row_fmt,col_fmt,shape",
    [
        (NVFP4(), None, (1, 72, 48)),  # rowwise NVFP4 with M % 16 != 0
        (None, MXFP8(), (1, 96, 40)),  # columnwise MXFP8 with K % 16 != 0 (a partial band of columns)
        (MXFP8(element="e5m2"), MXFP8(element="e5m2"), (3, 32, 96)),
        (NVFP4(rht=True), NVFP4(rht=True), (3, 48, 32)),
        (NVFP4(), MXFP8(), (1, 0, 64)),
    ],
    ids=str,
)
def test_shapes(row_fmt, col_fmt, shape):
    x = random_input(np.random.default_rng(3), shape, jnp.float32)
    check_quantize(x, row_fmt, col_fmt, "swizzled", what=f"{shape}")


# ---- edge values: E2M1 ties and midpoints, fp32 subnormals, E4M3 / E5M2 saturation, E8M0 extremes -----------------
def _edge_tensor():
    """float32 [1, 64, 64]: rows of block-sized edge patterns at scales 2^-149 .. 2^127 (E8M0 codes 0 .. 254)."""
    grid = np.array([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, -6.0], np.float32)
    mids = np.nextafter(grid, np.float32(np.inf)).astype(np.float32)
    rows = []
    with np.errstate(over="ignore", invalid="ignore"):
        for i, e in enumerate(range(-149, 128, 5)):
            s = np.float32(2.0) ** np.float32(e) if e > -127 else np.float32(np.ldexp(1.0, e))
            base = (grid if i % 2 == 0 else mids) * s
            row = np.concatenate([base, -base[::-1], np.resize(EDGE, 16), base * np.float32(448.0 / 6)])
            rows.append(row.astype(np.float32))
    return np.stack(rows + [np.resize(EDGE, 64)] * (64 - len(rows)))[:64].astype(np.float32)[None]


@pytest.mark.parametrize("row_fmt,col_fmt", [(NVFP4(), MXFP8()), (MXFP8(element="e5m2"), None),
                                             (NVFP4(local_1x64=True), NVFP4(local_1x64=True)),
                                             (NVFP4(scaling_2d=True), NVFP4(rht=True))], ids=str)
def test_edge_values(row_fmt, col_fmt):
    x = _edge_tensor()
    check_quantize(x, row_fmt, col_fmt, "compact", what="edge")
    check_quantize(x * np.float32(2.0**-100), row_fmt, col_fmt, "compact", what="edge * 2^-100")


# ---- stochastic rounding: streams and the sharded offsets ---------------------------------------------------------
def test_sr_shard_streams():
    """A shard's stream words (global offsets and dims) give the global tensor's bytes, as in the reference."""
    fmt = NVFP4(stochastic_rounding=True)
    x = random_input(np.random.default_rng(11), (2, 32, 64), jnp.bfloat16)
    k = jnp.asarray(KEY_WORDS)
    words_row = sr.shard_words(k, (1, 64, 128), (4, 256, 512))  # rowwise stored [P, M, K]
    words_col = sr.shard_words(k, (1, 32, 48), (4, 96, 512))  # columnwise stored [P, K, M]
    check_quantize(x, fmt, fmt, "compact", key_row=words_row, key_col=words_col, what="sharded SR")
    check_quantize(x, fmt, fmt, "compact", key_row=np.array([0xFFFFFFFF, 0], np.uint32),
                   key_col=np.array([0, 0xFFFFFFFF], np.uint32), what="SR extreme keys")


# ---- hypothesis: shapes and values ----------------------------------------------------------------------------------
_FMTS = [NVFP4(), NVFP4(stochastic_rounding=True), NVFP4(rht=True), MXFP8(), MXFP8(element="e5m2")]


@pytest.mark.slow  # property search (~40 s); the deterministic tests above run in the quick tier
@settings(max_examples=10, deadline=None)
@given(
    fmt_i=st.integers(0, len(_FMTS) - 1),
    p=st.integers(1, 2),
    m=st.sampled_from([32, 64]),
    k=st.sampled_from([32, 64, 96]),
    scale_exp=st.integers(-140, 120),
    seed=st.integers(0, 2**31 - 1),
    dt=st.sampled_from(DTYPES),
)
def test_hypothesis_quantize(fmt_i, p, m, k, scale_exp, seed, dt):
    fmt = _FMTS[fmt_i]
    rng = np.random.default_rng(seed)
    x = random_input(rng, (p, m, k), np.float32, scale_exp=scale_exp)
    with np.errstate(over="ignore"):
        x = x.astype(dt)
    check_quantize(x, fmt, fmt, "compact", what=f"{fmt!r} {dtype_id(dt)} 2^{scale_exp}")


# ---- amax and the RHT amax ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", DTYPES, ids=dtype_id)
def test_amax(dt):
    rng = np.random.default_rng(5)
    for shape in [(3, 1000), (70001,), (0, 4)]:
        x = jnp.asarray(random_input(rng, shape, dt))
        if x.size:
            _has_call(tensor_amax, (x,), "jf4_amax")
        assert_same_bits(jax.jit(tensor_amax)(x), jax.jit(reference_amax)(x), f"amax {shape}")
    for special in (np.full((33,), np.nan, np.float32), np.array([-np.inf, 1.0], np.float32),
                    np.array([1e-45, -3e-39], np.float32)):
        x = jnp.asarray(special.astype(dt) if dt != jnp.bfloat16 else special).astype(dt)
        assert_same_bits(jax.jit(tensor_amax)(x), jax.jit(reference_amax)(x), f"amax {special}")


@pytest.mark.parametrize("orientation", ["row", "col"])
def test_rht_amax(orientation):
    rng = np.random.default_rng(9)
    x = jnp.asarray(random_input(rng, (3, 48, 64), jnp.bfloat16))
    _has_call(functools.partial(rht_amax, orientation=orientation), (x,), "jf4_rht_amax")

    def ref(x):
        y = x if orientation == "row" else jnp.swapaxes(x, 1, 2)
        return reference_amax(rht.forward(y), axis=(1, 2))

    assert_same_bits(jax.jit(functools.partial(rht_amax, orientation=orientation))(x), jax.jit(ref)(x), "rht amax")
