"""Grouped (MoE) quantize / dequantize through the public API and the `jf4_grouped_*` primitives (CPU).

* contract: for each of the four shape representations, with traced group sizes drawn at random (empty groups
  included), every group of `grouped_quantize_rowwise_columnwise` equals the single-tensor `jax_fp4.quantize` of that
  group bit for bit (data, scales, amax; stochastic rounding with the documented keys fold_in(split(key)[i], g)),
  the padding past the last group is code 0, and the grouped dbias is within the fp32 summation bound;
* grouped_dequantize == the per-group `jax_fp4.dequantize`, bit for bit; requantizing is a fixed point (NVFP4 1D);
* alignment: static and concrete misalignment raise ValueError naming the group / shape; traced misalignment
  poisons only that group (NaN scales / amax / MXFP8 data -> NaN after dequantize);
* abstract-eval errors of the primitives, output shapes under eval_shape, vmap (lax.map batching rule).
Group shapes come from a small set so the per-group single-tensor quantize compiles a few times only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _quantize_util import assert_dbias_close, assert_same_bits, bits, jq, random_input

import jax_fp4
from jax_fp4 import MXFP8, NVFP4, GroupedQuantizedArray
from jax_fp4._src.primitives.grouped import grouped_dequantize_p, grouped_quantize_p
from jax_fp4.reference.grouped import Representation as R

N = 4
# Buffer shape and the candidate group dims (M_g, K_g) of every representation (all block-aligned for both formats).
SHAPES = {R.SAME_BOTH_DIMS: (96, 64), R.VARYING_FIRST_DIM: (N * 64, 32), R.VARYING_LAST_DIM: (32, N * 64),
          R.VARYING_BOTH_DIMS: (N * 2048,)}
PAIRS = ((0, 0), (0, 64), (32, 0), (32, 64), (64, 32))
# (rowwise, columnwise) formats per representation: together every format in both orientations, SR, RHT, E5M2.
FORMATS = {
    R.SAME_BOTH_DIMS: (NVFP4(), MXFP8()),
    R.VARYING_FIRST_DIM: (NVFP4(stochastic_rounding=True), NVFP4(rht=True, stochastic_rounding=True)),
    R.VARYING_LAST_DIM: (MXFP8(), NVFP4()),
    R.VARYING_BOTH_DIMS: (MXFP8(element="e5m2"), MXFP8()),
}


def _args(rep, fd, ld):
    """grouped_quantize's (group_sizes, last_dims) for a representation."""
    return {R.SAME_BOTH_DIMS: (3, None), R.VARYING_FIRST_DIM: (fd, None), R.VARYING_LAST_DIM: (None, ld),
            R.VARYING_BOTH_DIMS: (fd, ld)}[rep]


@functools.cache
def _grouped_rc(rep, row_fmt, col_fmt):
    """jit(grouped_quantize_rowwise_columnwise) with the sizes as traced arguments (one compile per config)."""
    dbias = rep is not R.VARYING_BOTH_DIMS

    def f(x, fd, ld, key):
        gs, last = _args(rep, fd, ld)
        return jax_fp4.grouped_quantize_rowwise_columnwise(x, gs, row_fmt, col_fmt, last_dims=last, key=key,
                                                           dbias=dbias)

    return jax.jit(f)


def _draw_dims(rng, rep):
    """numpy (rows, cols) of every group: random M_g / K_g from the candidate set (0 included)."""
    shape = SHAPES[rep]
    if rep is R.SAME_BOTH_DIMS:
        return np.full(3, shape[0] // 3), np.full(3, shape[1])
    if rep is R.VARYING_FIRST_DIM:
        return rng.choice([0, 32, 64], N), np.full(N, shape[1])
    if rep is R.VARYING_LAST_DIM:
        return np.full(N, shape[0]), rng.choice([0, 32, 64], N)
    rows, cols = np.array(PAIRS)[rng.integers(0, len(PAIRS), N)].T
    return rows, cols


def _groups(x, rows, cols):
    off = np.concatenate([[0], np.cumsum(rows * cols)])
    flat = np.asarray(x).reshape(-1)
    return off, [flat[off[g] : off[g + 1]].reshape(rows[g], cols[g]) for g in range(len(rows))]


def _check_group(got, xg, fmt, axis, key, what):
    if xg.size == 0:
        assert got.data.size == 0 and got.scale.size == 0, what
        if isinstance(fmt, NVFP4):
            assert float(got.amax) == 0.0, what
        return
    want = jq(jnp.asarray(xg), fmt, axis, key)
    assert_same_bits(got, want, what)


@pytest.mark.parametrize("rep", list(R), ids=lambda r: r.value)
def test_contract_each_group_equals_single_tensor_quantize(rng, rep):
    row_fmt, col_fmt = FORMATS[rep]
    rows, cols = _draw_dims(rng, rep)
    if rep is R.VARYING_FIRST_DIM:
        rows[rng.integers(N)] = 0  # always one empty group
    x = random_input(rng, SHAPES[rep], jnp.bfloat16)
    key = jax.random.key(int(rng.integers(2**31)))
    row, col, db = _grouped_rc(rep, row_fmt, col_fmt)(x, jnp.asarray(rows, jnp.int32), jnp.asarray(cols, jnp.int32),
                                                        key)
    off, xs = _groups(x, rows, cols)
    k_row, k_col = jax.random.split(key)
    for gq, fmt, axis, k in ((row, row_fmt, -1, k_row), (col, col_fmt, 0, k_col)):
        assert isinstance(gq, GroupedQuantizedArray) and gq.representation is rep and gq.shape == x.shape
        assert gq.fmt == fmt and gq.axis == axis and gq.data.shape == (x.size,)
        np.testing.assert_array_equal(gq.offsets, off)
        np.testing.assert_array_equal(gq.first_dims, rows)
        np.testing.assert_array_equal(gq.last_dims, cols)
        for g, (got, xg) in enumerate(zip(gq.split(), xs, strict=True)):
            _check_group(got, xg, fmt, axis, jax.random.fold_in(k, g), f"{rep.value} {fmt!r} axis {axis} group {g}")
        assert not bits(gq.data)[off[-1] :].any() and not bits(gq.scale)[off[-1] // fmt.block_size :].any()
    if rep is R.VARYING_BOTH_DIMS:
        assert db is None
        return
    coff = np.concatenate([[0], np.cumsum(cols)])
    for g, xg in enumerate(xs):
        got = db[g] if rep is not R.VARYING_LAST_DIM else db[coff[g] : coff[g + 1]]
        if xg.shape[1]:
            assert_dbias_close(got, np.asarray(xg, np.float32), f"dbias group {g}")


@functools.partial(jax.jit, static_argnames=("dtype",))
def _jdeq(q, dtype):
    return jax_fp4.dequantize(q, dtype)


@pytest.mark.parametrize("rep", [R.VARYING_FIRST_DIM, R.VARYING_BOTH_DIMS], ids=lambda r: r.value)
def test_dequantize_equals_single_tensor_dequantize(rng, rep):
    row_fmt, col_fmt = FORMATS[rep]
    rows, cols = _draw_dims(rng, rep)
    x = random_input(rng, SHAPES[rep], jnp.bfloat16)
    row, col, _ = _grouped_rc(rep, row_fmt, col_fmt)(x, jnp.asarray(rows), jnp.asarray(cols), jax.random.key(3))
    off, _ = _groups(x, rows, cols)
    deq = jax.jit(jax_fp4.grouped_dequantize, static_argnames=("dtype",))
    for gq in (row, col):
        out = deq(gq, dtype=jnp.bfloat16)
        assert out.shape == x.shape and out.dtype == jnp.bfloat16
        flat = bits(out).reshape(-1)
        for g, q in enumerate(gq.split()):
            if q.data.size:
                want = bits(_jdeq(q, jnp.bfloat16)).reshape(-1)
                np.testing.assert_array_equal(flat[off[g] : off[g + 1]], want, err_msg=f"{gq.fmt!r} group {g}")
        assert not flat[off[-1] :].any()


def test_requantize_is_a_fixed_point():
    """grouped_quantize(grouped_dequantize(q)) == q (codes; amax within 3 ulps), NVFP4 1D, as the single-tensor
    property (tests/reference/test_properties.py, which explains why): normal data, no subnormal block scales."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((128, 32)) * 10.0 ** rng.uniform(-1, 1, (128, 1)), jnp.float32)
    f = jax.jit(lambda x, gs: jax_fp4.grouped_quantize(x, gs, NVFP4()))
    gs = jnp.array([16, 0, 80, 32])
    q = f(x, gs)
    q2 = f(jax_fp4.grouped_dequantize(q), gs)
    np.testing.assert_array_equal(bits(q2.data), bits(q.data))
    np.testing.assert_array_equal(bits(q2.scale), bits(q.scale))
    assert np.max(np.abs(bits(q2.amax).astype(np.int64) - bits(q.amax).astype(np.int64))) <= 3


def test_traced_misaligned_groups_are_poisoned():
    """Columnwise over the tokens with traced sizes [32, 48, 40, 40]: MXFP8 (blocks of 32) poisons groups 1-3, NVFP4
    (blocks of 16) groups 2-3; a poisoned group dequantizes to NaN, the aligned ones keep the contract."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((160, 32)), jnp.float32)
    sizes = jnp.array([32, 48, 40, 40], jnp.int32)
    f = jax.jit(lambda x, gs: jax_fp4.grouped_quantize_rowwise_columnwise(x, gs, None, MXFP8())[1])
    h = jax.jit(lambda x, gs: jax_fp4.grouped_quantize(x, gs, NVFP4(), axis=0))
    for gq, bad in ((f(x, sizes), (1, 2, 3)), (h(x, sizes), (2, 3))):
        out = np.asarray(jax_fp4.grouped_dequantize(gq))
        off = np.concatenate([[0], np.cumsum(np.asarray(sizes) * 32)])
        for g in range(4):
            part = out.reshape(-1)[off[g] : off[g + 1]]
            assert np.isnan(part).all() if g in bad else np.isfinite(part).all(), (gq.fmt, g)
        if isinstance(gq.fmt, NVFP4):
            assert np.isnan(np.asarray(gq.amax)[list(bad)]).all()
    # The aligned groups keep the contract.
    q = jq(x[:32], MXFP8(), 0)
    assert_same_bits(f(x, sizes).split()[0], q, "aligned group 0")


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: jax_fp4.grouped_quantize(jnp.ones((64, 32)), np.array([32, 24]), MXFP8(), axis=0),
         "group 1 .* first dim M = 24 is not a multiple of the block size 32"),
        (lambda: jax_fp4.grouped_quantize(jnp.ones((32, 72)), None, NVFP4(), last_dims=[16, 40, 16]),
         "group 1 .* last dim K = 40"),
        (lambda: jax_fp4.grouped_quantize(jnp.ones((64, 24)), 2, NVFP4()), "last dim K is 24"),
        (lambda: jax_fp4.grouped_quantize(jnp.ones((64, 64)), np.array([48, 32]), NVFP4()), "more than x"),
        (lambda: jax_fp4.grouped_quantize(jnp.ones((64, 64)), np.array([32, -16]), NVFP4()), "negative"),
        (lambda: jax_fp4.grouped_quantize(jnp.ones((64, 32)), 3, NVFP4()), "not divisible"),
        (lambda: jax_fp4.grouped_quantize(jnp.ones((64, 32)), 2, NVFP4(scaling_2d=True)), "not supported for grouped"),
        (lambda: jax_fp4.grouped_quantize(jnp.ones((64, 64)), 2, NVFP4(local_1x64=True)), "jax.vmap"),
        (lambda: jax_fp4.grouped_quantize(jnp.ones((64, 32)), 2, NVFP4(stochastic_rounding=True)), "PRNG key"),
        (lambda: jax_fp4.grouped_quantize(jnp.ones((64, 32), jnp.int32), 2, MXFP8()), "bfloat16, float16 or float32"),
        (lambda: jax_fp4.grouped_quantize(jnp.ones((64, 32)), 2, MXFP8(), axis=2), "axis must be"),
        (lambda: jax_fp4.grouped_quantize(jnp.ones((64, 32)), 2, MXFP8(), last_dims=[32, 32]), "takes no last_dims"),
        (lambda: jax_fp4.grouped_quantize(jnp.ones((64, 32)), None, MXFP8()), "give group_sizes"),
        (lambda: jax_fp4.grouped_quantize(jnp.ones((64, 32)), [32, 32], MXFP8(), last_dims=[32, 32]), "1-D x"),
        (lambda: jax_fp4.grouped_quantize_rowwise_columnwise(jnp.ones((64, 32)), 2, None, None), "both formats"),
        (lambda: jax_fp4.grouped_quantize_rowwise_columnwise(jnp.ones((2048,)), [32, 32], MXFP8(), None,
                                                             last_dims=[32, 32], dbias=True), "dbias needs"),
        (lambda: jax_fp4.grouped_dequantize(jnp.ones(4)), "expects a jax_fp4.GroupedQuantizedArray"),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_static_misalignment_raises_under_jit():
    f = jax.jit(lambda x, gs: jax_fp4.grouped_quantize(x, gs, MXFP8()))
    with pytest.raises(ValueError, match="last dim K is 48"):
        f(jnp.ones((64, 48)), jnp.array([32, 32]))
    g = jax.jit(lambda x, ks: jax_fp4.grouped_quantize(x, None, NVFP4(), last_dims=ks, axis=0))
    with pytest.raises(ValueError, match="first dim M is 24"):
        g(jnp.ones((24, 64)), jnp.array([32, 32]))


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize(
    "operands, params, match",
    [
        ((_sds((64, 32), jnp.float32), _sds((2,), jnp.int32), _sds((3,), jnp.int32)), {}, "same N"),
        ((_sds((64, 32), jnp.float32), _sds((2,), jnp.int64 if jax.config.jax_enable_x64 else jnp.uint32),
          _sds((2,), jnp.int32)), {}, "int32"),
        ((_sds((64,), jnp.float32), _sds((2,), jnp.int32), _sds((2,), jnp.int32)), {}, "needs a 2-D buffer"),
        ((_sds((64, 32), jnp.float32), _sds((2,), jnp.int32), _sds((2,), jnp.int32)), {"key_row": (2, 3)},
         "key_row must be uint32"),
        ((_sds((64, 32), jnp.int8), _sds((2,), jnp.int32), _sds((2,), jnp.int32)), {}, "bfloat16, float16"),
        ((_sds((64, 24), jnp.float32), _sds((2,), jnp.int32), _sds((2,), jnp.int32)), {}, "last dim K is 24"),
        ((_sds((64, 32), jnp.float32), _sds((2,), jnp.int32), _sds((2,), jnp.int32)),
         {"row_fmt": NVFP4(scaling_2d=True)}, "not supported"),
        ((_sds((64, 32), jnp.float32), _sds((2,), jnp.int32), _sds((2,), jnp.int32)),
         {"amax_given": 1, "amax_in": (4,)}, "needs an NVFP4 rowwise format"),
        ((_sds((64, 32), jnp.float32), _sds((2,), jnp.int32), _sds((2,), jnp.int32)),
         {"row_fmt": NVFP4(), "amax_given": 1, "amax_in": (2,)}, r"amax_in must be float32\[4\]"),
        ((_sds((64, 32), jnp.float32), _sds((2,), jnp.int32), _sds((2,), jnp.int32)),
         {"row_fmt": NVFP4(), "amax_in": (4,)}, r"amax_in must be float32\[0\]"),
        ((_sds((64, 32), jnp.float32), _sds((2,), jnp.int32), _sds((2,), jnp.int32)),
         {"row_fmt": NVFP4(), "amax_given": 4, "amax_in": (4,)}, "amax_given must be an int in 0..3"),
    ],
)
def test_quantize_primitive_abstract_eval_errors(operands, params, match):
    x, fd, ld = operands
    kr = params.pop("key_row", (fd.shape[0], 2))
    am = params.pop("amax_in", (0,))
    p = dict(row_fmt=MXFP8(), col_fmt=None, representation=R.VARYING_FIRST_DIM, dbias=False, amax_given=0) | params
    args = (x, fd, ld, _sds(kr, jnp.uint32), _sds((fd.shape[0], 2), jnp.uint32), _sds(am, jnp.float32))
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda *a: grouped_quantize_p.bind(*a, **p), *args)


def test_dequantize_primitive_abstract_eval_errors():
    dims = (_sds((2,), jnp.int32), _sds((2,), jnp.int32))
    p = dict(fmt=NVFP4(), axis=-1, x_shape=(64, 32), out_dtype=jnp.dtype(jnp.float32), raw=False)
    good = (_sds((2048,), jnp.float4_e2m1fn), _sds((128,), jnp.float8_e4m3fn), _sds((2,), jnp.float32))
    assert jax.eval_shape(lambda *a: grouped_dequantize_p.bind(*a, **p), *good, *dims).shape == (64, 32)
    for i, bad, match in ((0, _sds((2048,), jnp.float8_e4m3fn), "data must be"), (1, _sds((64,), jnp.float8_e4m3fn),
                          "scale must be"), (2, _sds((0,), jnp.float32), "amax must be")):
        ops = list(good)
        ops[i] = bad
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(lambda *a: grouped_dequantize_p.bind(*a, **p), *ops, *dims)
    with pytest.raises(ValueError, match="output dtype"):
        jax.eval_shape(lambda *a: grouped_dequantize_p.bind(*a, **(p | {"out_dtype": jnp.dtype(jnp.int8)})), *good,
                       *dims)


@pytest.mark.parametrize("rep", list(R), ids=lambda r: r.value)
def test_shapes_under_eval_shape(rep):
    row_fmt, col_fmt = FORMATS[rep]
    shape = SHAPES[rep]
    fd = ld = jax.ShapeDtypeStruct((N,), jnp.int32)

    def f(x, fd, ld):
        gs, last = _args(rep, fd, ld)
        return jax_fp4.grouped_quantize_rowwise_columnwise(x, gs, row_fmt, col_fmt, last_dims=last,
                                                           key=jax.random.key(0), dbias=rep is not R.VARYING_BOTH_DIMS)

    row, col, db = jax.eval_shape(f, jax.ShapeDtypeStruct(shape, jnp.bfloat16), fd, ld)
    n = 3 if rep is R.SAME_BOTH_DIMS else N
    size = int(np.prod(shape))
    for gq, fmt in ((row, row_fmt), (col, col_fmt)):
        assert gq.data.shape == (size,) and gq.data.dtype == fmt.data_dtype
        assert gq.scale.shape == (size // fmt.block_size,) and gq.scale.dtype == fmt.scale_dtype
        assert (gq.amax is None) == isinstance(fmt, MXFP8) and (gq.amax is None or gq.amax.shape == (n,))
        assert gq.offsets.shape == (n + 1,) and gq.num_groups == n
    if rep is R.VARYING_BOTH_DIMS:
        assert db is None
    else:
        assert db.shape == ((shape[1],) if rep is R.VARYING_LAST_DIM else (n, shape[1])) and db.dtype == jnp.float32


def test_vmap():
    """vmap over a batch of buffers (sizes shared, keys batched): each example equals its unbatched call; the
    batched GroupedQuantizedArray dequantizes under vmap."""
    fmt = NVFP4(stochastic_rounding=True)
    f = jax.jit(lambda x, gs, key: jax_fp4.grouped_quantize(x, gs, fmt, key=key))
    rows = np.array([64, 0, 32, 64])
    xb = jnp.stack([random_input(np.random.default_rng(s), (N * 64, 32), jnp.bfloat16) for s in (5, 6)])
    keys = jax.random.split(jax.random.key(7), 2)
    batched = jax.jit(jax.vmap(f, in_axes=(0, None, 0)))(xb, rows, keys)
    assert batched.data.shape == (2, xb[0].size) and batched.amax.shape == (2, N)
    deq = jax.jit(jax.vmap(jax_fp4.grouped_dequantize))(batched)
    for i in range(2):
        one = f(xb[i], rows, keys[i])
        assert_same_bits(jax.tree.map(lambda a, i=i: a[i], batched), one, f"example {i}")
        assert_same_bits(deq[i], jax_fp4.grouped_dequantize(one), f"dequantize example {i}")



@pytest.mark.parametrize("axis", [-1, 0])
def test_bf16_subnormal_inputs_are_kept(axis):
    """bfloat16 subnormals are values, not zeros (docs/numerics.md: IEEE, subnormals kept), on XLA:CPU too.

    Each group's amax is bf16 max, so a block holding only the largest bf16 subnormal (0x007F, about 1.17e-38) gets
    E4M3 scale code 0 and the multiplier FLT_MAX: 1.17e-38 * FLT_MAX = 3.96 -> E2M1 4.0 (code 6; 0xE in group 1,
    whose values are negated). A widening that flushed subnormals gave code 0 (XLA:CPU's bf16 -> f32 convert inside
    the grouped gather, jax 0.11.2).
    """
    u = np.zeros((32, 32), np.uint16)
    u[0, 0] = 0x7F7F  # bf16 max
    if axis == -1:
        u[1, :] = 0x007F  # row 1: two 1x16 blocks of subnormals
    else:
        u[:, 1] = 0x007F  # column 1: two 16x1 blocks of subnormals (row 1 of the stored [K, M] data)
    u = np.concatenate([u, u | np.uint16(0x8000) * (u != 0)])  # group 1: negated
    x = jnp.asarray(u.view(jnp.bfloat16))
    gq = jax.jit(lambda x, gs: jax_fp4.grouped_quantize(x, gs, NVFP4(), axis=axis))(x, jnp.asarray([32, 32]))
    for g, (got, xg) in enumerate(zip(gq.split(), (x[:32], x[32:]), strict=True)):
        codes = bits(got.data)
        assert (codes[1] == 0x6 | (0x8 * g)).all(), f"group {g}: codes of the subnormal blocks {codes[1]}"
        assert_same_bits(got, jq(xg, NVFP4(), axis, None), f"group {g} vs single-tensor quantize")


@pytest.mark.parametrize("row_fmt,col_fmt", [(NVFP4(), NVFP4(rht=True)), (NVFP4(), MXFP8())],
                         ids=["nvfp4-rht", "nvfp4-mxfp8"])
def test_given_amax(rng, row_fmt, col_fmt):
    """A given per-group amax: the groups' own amax gives the computed result bit for bit; any other amax gives each
    group's NVFP4 encode with that tensor amax (reference.nvfp4.quantize_with_amax of the single tensor)."""
    from jax_fp4.reference import nvfp4

    rows = np.array([64, 0, 32, 96], np.int32)
    x = jnp.asarray(random_input(rng, (int(rows.sum()), 64), jnp.bfloat16))
    f = jax.jit(lambda x, fd, ra, ca: jax_fp4.grouped_quantize_rowwise_columnwise(
        x, fd, row_fmt, col_fmt, row_amax=ra, col_amax=ca)[:2])
    row, col = f(x, rows, None, None)
    given_col = col.amax if isinstance(col_fmt, NVFP4) else None
    for got, want in zip(f(x, rows, row.amax, given_col), (row, col), strict=True):
        assert_same_bits(got.data, want.data, "own amax: data")
        assert_same_bits(got.scale, want.scale, "own amax: scale")
    amax = jnp.asarray(rng.uniform(0.5, 8.0, len(rows)), jnp.float32)
    got = jax.jit(lambda x, fd, a: jax_fp4.grouped_quantize(x, fd, row_fmt, amax=a))(x, rows, amax)
    assert_same_bits(got.amax, amax, "given amax returned")
    off = np.concatenate([[0], np.cumsum(rows)]) * 64
    for g in np.flatnonzero(rows):
        xg = x.reshape(-1)[off[g] : off[g + 1]].reshape(rows[g], 64)
        want = nvfp4.quantize_with_amax(nvfp4.prepare(xg, row_fmt), row_fmt, amax[g])
        codes = np.asarray(want.codes, np.uint8).reshape(-1)
        scale_codes = np.asarray(want.scale_codes, np.uint8).reshape(-1)
        assert_same_bits(bits(got.data)[off[g] : off[g + 1]], codes, f"group {g} data")
        assert_same_bits(bits(got.scale)[off[g] // 16 : off[g + 1] // 16], scale_codes, f"group {g} scale")


def test_given_amax_errors():
    x = jnp.zeros((64, 32), jnp.float32)
    with pytest.raises(ValueError, match="needs an NVFP4 format"):
        jax_fp4.grouped_quantize(x, np.array([32, 32]), MXFP8(), amax=jnp.ones(2))
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        jax_fp4.grouped_quantize(x, np.array([32, 32]), NVFP4(), amax=jnp.ones(3))
