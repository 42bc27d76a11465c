"""NVFP4 4over6 (`NVFP4(use_4over6=True)`, docs/numerics.md section 1 "4over6") against an independent numpy model of
TE's quantizer (tests/_te_4over6.py), bit for bit: codes, block scales and dequantized values, on the reference
functions and on the public op (the CPU handler where built), for random inputs over the whole fp32 range and the
edge blocks (ties between the two errors, all-zero blocks, 4 : 6 ratios, subnormals, near overflow, NaN / inf).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from jax_fp4 import recipes
from jax_fp4._src import ffi
from jax_fp4.reference import nvfp4 as ref_nvfp4

from ._util import codes_of, p2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _te_4over6 as te  # noqa: E402

SHAPE = (32, 64)  # two 16x16-tile rows, four 16-blocks a row: every case shares one compilation per format
CONFIGS = [dict(e4m3_max=256, err_mode="MAE", two_d=False), dict(e4m3_max=256, err_mode="MAE", two_d=True),
           dict(e4m3_max=256, err_mode="MSE", two_d=False), dict(e4m3_max=448, err_mode="MAE", two_d=True)]


def _fmt(c):
    return jax_fp4.NVFP4(use_4over6=True, e4m3_max=c["e4m3_max"], err_mode_4over6=c["err_mode"],
                         scaling_2d=c["two_d"])


def _cid(c):
    return f"{'2d' if c['two_d'] else '1d'}-{c['err_mode']}-{c['e4m3_max']}"


@functools.cache
def _ops(fmt):
    q = jax.jit(lambda x: jax_fp4.quantize(x, fmt))
    dq = jax.jit(lambda q: jax_fp4.dequantize(q, jnp.float32))
    ref = jax.jit(lambda x, a: ref_nvfp4.quantize_with_amax(ref_nvfp4.prepare(x, fmt), fmt, a)[:2])
    return q, dq, ref


def _inputs(rng):
    """Random [32, 64] float32 inputs: heavy-tailed values at several magnitudes (subnormal to near overflow)."""
    out = {}
    for name, scale in (("unit", 1.0), ("subnormal", 1e-40), ("tiny", 3e-36), ("huge", 1e33), ("ftz-mix", 1e-30)):
        x = rng.standard_normal(SHAPE) * rng.exponential(1.0, SHAPE) ** 3 * scale
        out[name] = x.astype(np.float32)
    out["bf16-grid"] = np.asarray(jnp.asarray(rng.standard_normal(SHAPE), jnp.bfloat16).astype(jnp.float32))
    # both choices for certain (amax 6, S_enc = 6B / 6): the block / tile holding the 6 and zeros ties (map-to-6); the
    # 16x16 tile of 4s is exact only under map-to-4 (worked out in test_hand_worked_blocks for B = 256)
    both = np.zeros(SHAPE, np.float32)
    both[0, 0], both[16:32, 16:32] = 6.0, 4.0
    out["both-choices"] = both
    return out


def _edge_rows(big: bool):
    """[32, 64] of edge blocks (row r, block j; the rest zeros); `big` adds a near-overflow block (it sets the tensor
    amax, so the other blocks then sit in the subnormal range of the encode)."""
    x = np.zeros(SHAPE, np.float32)
    x[0, 0:16] = 6.0  # a block at its amax: both candidates exact -> tie -> map-to-6
    x[1, 0:16] = 4.0  # all 4s: map-to-4 represents it exactly, map-to-6 does not
    x[2, 0:16] = np.tile([4.0, 6.0], 8)  # the 4 : 6 ratio
    x[3, 0:16] = np.tile([2.0, 3.0, 4.0, 6.0], 4)
    x[4, 16:32] = np.array([p2(-149) * k for k in range(16)], np.float32)  # fp32 subnormals
    x[5, 16:32] = 1e-39
    x[6, 0:16] = np.linspace(-5, 5, 16, dtype=np.float32)
    if big:
        x[7, 32:48] = np.float32(3.0e38) * np.linspace(0.1, 1, 16, dtype=np.float32)  # near overflow
    x[8, 0:16] = [np.nan] + [1.0] * 15  # NaN in a block
    x[9, 48:64] = [np.inf] + [2.0] * 15  # inf in a block
    x[10, 48:64] = [-np.inf] + [0.5] * 15
    return x


def _check(x, c, q, ref_codes=None):
    """q: a QuantizedArray of x under config c; ref_codes: (codes, scale codes) of the reference function."""
    want_q, want_sc, amax = te.quantize_4over6(x, e4m3_max=c["e4m3_max"], err_mode=c["err_mode"], two_d=c["two_d"])
    got_q, got_sc = codes_of(q.data), codes_of(q.scale)
    np.testing.assert_array_equal(got_sc, want_sc, err_msg=f"scale codes {_cid(c)}")
    np.testing.assert_array_equal(got_q, want_q, err_msg=f"E2M1 codes {_cid(c)}")
    if ref_codes is not None:
        np.testing.assert_array_equal(np.asarray(ref_codes[0]), want_q)
        np.testing.assert_array_equal(np.asarray(ref_codes[1]), want_sc)
    return want_q, want_sc, amax


@pytest.mark.parametrize("c", CONFIGS, ids=_cid)
def test_random_inputs_match_te_model(rng, c):
    fmt = _fmt(c)
    quant, deq, ref = _ops(fmt)
    picks = []
    for name, x in _inputs(rng).items():
        q = quant(jnp.asarray(x))
        amax = jnp.float32(te.quantize_4over6(x)[2])
        want_q, want_sc, a = _check(x, c, q, ref(jnp.asarray(x), amax))
        if not np.isinf(a) and a < np.float32(3.4e38) / 448:  # the model's range (te.dequantize's docstring)
            got = np.asarray(deq(q))
            want = te.dequantize(want_q, want_sc, a, c["e4m3_max"])
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"dequantize {name}")
        picks.append(te.quantize_4over6(x, e4m3_max=c["e4m3_max"], err_mode=c["err_mode"], two_d=c["two_d"],
                                        with_pick=True)[3])
    share = np.mean(np.concatenate([p.reshape(-1) for p in picks]))
    assert 0 < share < 1, share  # both candidates occur, so a selection stuck on one side would fail


@pytest.mark.parametrize("c", CONFIGS[:2], ids=_cid)
def test_edge_blocks(c):
    fmt = _fmt(c)
    quant, _, _ = _ops(fmt)
    for big in (False, True):
        x = _edge_rows(big)
        _check(x, c, quant(jnp.asarray(x)))
    x = _edge_rows(False)
    x[8, 0] = x[9, 48] = x[10, 48] = 0.0  # finite: amax 6, S_enc = 1536 / 6 = 256
    pick = te.quantize_4over6(x, e4m3_max=c["e4m3_max"], err_mode=c["err_mode"], two_d=c["two_d"], with_pick=True)[3]
    if not c["two_d"]:
        assert not pick[0, 0] and pick[1, 0]  # the tie keeps map-to-6; all 4s take map-to-4


def test_hand_worked_blocks():
    """amax 1536 (e4m3_max 256): S_enc = 1, so a block's base is its amax / 6 (docs/numerics.md section 1)."""
    x = np.zeros((1, 48), np.float32)
    x[0, 0] = 1536.0  # block 0 sets the tensor amax
    x[0, 16:32] = 6.0  # base 1: s6 = 1 (0x38), s4 = 1.5 (0x3C); both reconstruct exactly -> tie -> map-to-6
    x[0, 32:48] = 4.0  # base 0.6666667: s6 = e4m3 0.6875 (0x33), 4 * 1.4545455 -> 6 -> err 16 * 0.125;
    #                   s4 = e4m3(1.0) = 0x38, 4 * 1 -> 4 -> err 0 -> map-to-4
    q = jax_fp4.quantize(jnp.asarray(x), jax_fp4.NVFP4(use_4over6=True))
    sc, codes = codes_of(q.scale)[0], codes_of(q.data)[0]
    assert sc[1] == 0x38 and np.all(codes[16:32] == 0x7)
    assert sc[2] == 0x38 and np.all(codes[32:48] == 0x6)
    assert np.all(np.asarray(jax_fp4.dequantize(q, jnp.float32))[0, 16:48] == x[0, 16:48])


def test_columnwise_is_rowwise_of_transpose(rng):
    x = rng.standard_normal(SHAPE).astype(np.float32)
    for fmt in (_fmt(CONFIGS[0]), _fmt(CONFIGS[1])):
        col = jax_fp4.quantize(jnp.asarray(x), fmt, axis=0)
        row_t = jax_fp4.quantize(jnp.asarray(x.T), fmt, axis=-1)
        np.testing.assert_array_equal(codes_of(col.data), codes_of(row_t.data))
        np.testing.assert_array_equal(codes_of(col.scale), codes_of(row_t.scale))


@pytest.mark.skipif(not ffi.HAS_CPU_KERNELS, reason="CPU extension not built")
def test_cpu_handler_equals_reference(rng):
    """The host handler (jf4_quantize, 4over6 band encoder) and the reference lowering give the same bits, with the
    exact operand and swizzled scales too."""
    x = jnp.asarray(rng.standard_normal((2, 48, 64)).astype(np.float32))
    for fmt in (_fmt(CONFIGS[1]), _fmt(CONFIGS[2])):
        f = jax.jit(lambda x, fmt=fmt: jax_fp4.quantize_rowwise_columnwise(x.reshape(96, 64), fmt, fmt,
                                                                           exact=(True, False)))
        got = f(x)
        with ffi.reference_lowering_on_cpu():
            want = jax.jit(lambda x, fmt=fmt: jax_fp4.quantize_rowwise_columnwise(x.reshape(96, 64), fmt, fmt,
                                                                                  exact=(True, False)))(x)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.atleast_1d(np.asarray(g)).view(np.uint8),
                                          np.atleast_1d(np.asarray(w)).view(np.uint8))


def test_options_and_recipes():
    f = jax_fp4.NVFP4(use_4over6=True)
    assert f.global_e4m3_max == 256 and f == jax_fp4.NVFP4(use_4over6=True, e4m3_max=256)
    assert hash(f) == hash(jax_fp4.NVFP4(use_4over6=True, e4m3_max=256))
    assert jax_fp4.NVFP4(use_4over6=True, e4m3_max=448).global_e4m3_max == 448
    assert jax_fp4.NVFP4().global_e4m3_max == 448
    assert jax_fp4.NVFP4(use_4over6=True, err_mode_4over6="mse").err_mode_4over6 == "MSE"
    for bad in (dict(rht=True), dict(stochastic_rounding=True), dict(local_1x64=True)):
        with pytest.raises(ValueError, match="use_4over6 excludes"):
            jax_fp4.NVFP4(use_4over6=True, **bad)
    with pytest.raises(ValueError, match="e4m3_max=256 needs use_4over6"):
        jax_fp4.NVFP4(e4m3_max=256)
    with pytest.raises(ValueError, match="e4m3_max must be"):
        jax_fp4.NVFP4(use_4over6=True, e4m3_max=300)
    with pytest.raises(ValueError, match="err_mode_4over6"):
        jax_fp4.NVFP4(use_4over6=True, err_mode_4over6="max")
    for name in ("nvfp4-4over6", "nvfp4-fwd-mxfp8-bwd-4over6", "nvfp4-no-rht-4over6",
                 "nvfp4-fwd-mxfp8-bwd-hybrid-4over6"):
        r = recipes.by_name(name)
        assert r.name == name and recipes.by_name(r.name) == r
        assert r.fprop_x.use_4over6 and r.fprop_w.use_4over6
        assert not any(f is not None and f.use_4over6 for f in (r.dgrad_dy, r.wgrad_x, r.wgrad_dy))


def test_gemm_uses_the_256_tensor_scale(rng):
    """A 4over6 GEMM (tensor scale amax / 1536) equals the float64 product of the dequantized operands within the
    emulation's bound (exact products, fp32 sums of K = 64 terms: a few hundred ulps at most)."""
    a = rng.standard_normal((16, 64)).astype(np.float32)
    b = rng.standard_normal((32, 64)).astype(np.float32)
    fmt = jax_fp4.NVFP4(use_4over6=True)
    qa, qb = jax_fp4.quantize(jnp.asarray(a), fmt), jax_fp4.quantize(jnp.asarray(b), fmt)
    got = np.asarray(jax_fp4.scaled_dot_general(qa, qb, (((1,), (1,)), ((), ())), implementation="emulated"))
    da = np.asarray(jax_fp4.dequantize(qa, jnp.float32), np.float64)
    db = np.asarray(jax_fp4.dequantize(qb, jnp.float32), np.float64)
    want = da @ db.T
    bound = 70 * 2.0**-24 * (np.abs(da) @ np.abs(db).T)  # K + 6 roundings of u per term, derived as in _gemm_util
    assert np.all(np.abs(got - want) <= bound)
    with pytest.raises(ValueError, match="kernel"):  # no device kernel here; on Hopper the message names 4over6
        jax_fp4.scaled_dot_general(qa, qb, (((1,), (1,)), ((), ())), implementation="kernel")


def test_grouped_equals_single_tensor(rng):
    x = rng.standard_normal((64, 32)).astype(np.float32)
    fmt = jax_fp4.NVFP4(use_4over6=True)
    gq = jax_fp4.grouped_quantize(jnp.asarray(x), np.array([16, 48], np.int32), fmt)
    for g, (lo, hi) in enumerate(((0, 16), (16, 64))):
        one = jax_fp4.quantize(jnp.asarray(x[lo:hi]), fmt)
        np.testing.assert_array_equal(codes_of(gq.data).reshape(-1)[lo * 32:hi * 32], codes_of(one.data).reshape(-1))
        np.testing.assert_array_equal(np.asarray(gq.amax)[g], np.asarray(one.amax))


@pytest.mark.parametrize("name", ["nvfp4-fwd-mxfp8-bwd-4over6", "nvfp4-4over6"])
def test_dense_forward_uses_the_4over6_operands(rng, name):
    """jax_fp4.dense's forward (exact operands straight from the quantize pass) equals the float64 product of the
    dequantized 4over6 operands within the emulation's bound: the tensor scales are amax / 1536, not / 2688."""
    recipe = recipes.by_name(name)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    y = np.asarray(jax.jit(lambda x, w: jax_fp4.dense(x, w, recipe=recipe))(x, w), np.float64)
    dx = np.asarray(jax_fp4.dequantize(jax_fp4.quantize(jnp.asarray(x), recipe.fprop_x), jnp.float32), np.float64)
    dw = np.asarray(jax_fp4.dequantize(jax_fp4.quantize(jnp.asarray(w), recipe.fprop_w, axis=0), jnp.float32),
                    np.float64)
    want = dx @ dw
    bound = 70 * 2.0**-24 * (np.abs(dx) @ np.abs(dw))
    assert np.all(np.abs(y - want) <= bound)


@pytest.mark.skipif(not ffi.HAS_CPU_KERNELS, reason="CPU extension not built")
def test_grouped_cpu_handlers_equal_reference(rng):
    """jf4_grouped_quantize / jf4_grouped_dequantize on the host: 4over6 groups (three groups, both
    orientations) and their dequantize (tensor scales on the 256 bound) equal the reference lowering bit for bit."""
    x = jnp.asarray(rng.standard_normal((96, 64)).astype(np.float32))
    sizes = np.array([32, 48, 16], np.int32)
    fmt = jax_fp4.NVFP4(use_4over6=True)

    def f(x):
        row, col, _ = jax_fp4.grouped_quantize_rowwise_columnwise(x, sizes, fmt, jax_fp4.NVFP4(use_4over6=True,
                                                                                                  err_mode_4over6="MSE"))
        return row, col, jax_fp4.grouped_dequantize(row, jnp.float32), jax_fp4.grouped_dequantize(col, jnp.bfloat16)

    got = jax.jit(f)(x)
    with ffi.reference_lowering_on_cpu():
        want = jax.jit(f)(x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.atleast_1d(np.asarray(g)).view(np.uint8),
                                      np.atleast_1d(np.asarray(w)).view(np.uint8))
