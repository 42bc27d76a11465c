"""The CUDA quantize kernels (`jf4_quantize`, `jf4_rht_amax` FFI targets) against the bit-exact reference.

Every test runs the same jitted function on the GPU (the CUDA lowering; its HLO must hold the custom call, so a test
cannot silently pass on the reference) and on the CPU device (`jax.devices("cpu")[0]`, where the primitives lower to
`jax_fp4.reference`), and asserts equal bits for every output leaf; a mismatch is reported by the first differing
flat index and both codes. dbias is an fp32 sum whose order differs between the kernel and the reference, so it is
checked against the float64 column sums within the fp32 summation bound instead of bit for bit.

All tests are marked `gpu` (skipped where jax's default backend is not a GPU). Replay a failure with the session seed
printed in the pytest header: JAX_FP4_SEED=<seed>.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cmd_buffer_util import assert_command_buffer_runs
from _quantize_util import (
    FORMATS,
    PAIRS,
    assert_dbias_close,
    assert_dbias_partials_close,
    assert_leaf_bits,
    assert_same_bits,
    bits,
    command_buffer_input,
    command_buffer_workload,
    dtype_id,
    fmt_id,
    needs_key,
    pair_id,
    random_input,
    special_inputs,
    vmap_marks,
)

import jax_fp4
from jax_fp4 import MXFP8, NVFP4, reference
from jax_fp4._src import ffi
from jax_fp4._src.primitives.quantize import (
    OUTPUT_NAMES,
    ffi_attributes,
    kernel_supports,
    quantize_3d,
    reference_outputs,
)
from jax_fp4._src.primitives.rht_amax import rht_amax

pytestmark = pytest.mark.gpu

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
KEY = jax.random.key(1234)


# ---- running on both devices -----------------------------------------------------------------------------------------
def _gpu():
    return jax.devices("gpu")[0]


def _cpu():
    return jax.devices("cpu")[0]


def _custom_call(name):
    return re.compile(rf"custom_call\s*@{name}\b")


def assert_custom_calls(fn, args, present=("jf4_quantize",), absent=()):
    """The jitted `fn`, lowered for the GPU, holds a custom call to each of `present` and to none of `absent`."""
    assert ffi.HAS_CUDA_KERNELS, f"GPU test without the CUDA extension: {ffi.import_error()}"
    text = jax.jit(fn).lower(*jax.device_put(args, _gpu())).as_text()
    for name in present:
        assert _custom_call(name).search(text), f"no {name} custom call in the GPU HLO:\n{text[:20000]}"
    for name in absent:
        assert not _custom_call(name).search(text), f"unexpected {name} custom call in the GPU HLO"


def run_on(device, fn, *args):
    """jax.jit(fn) on `device` (arguments committed there), results fetched to numpy."""
    out = jax.jit(fn)(*jax.device_put(args, device))
    if device.platform != "cpu":
        for leaf in jax.tree.leaves(out):
            assert leaf.devices() == {device}, leaf.devices()
    return jax.device_get(out)


def gpu_vs_cpu(fn, *args, present=("jf4_quantize",), absent=(), skip=(), what=""):
    """Assert the GPU lowering holds the custom calls, and GPU bits == CPU (reference) bits; returns (gpu, cpu)."""
    assert_custom_calls(fn, args, present, absent)
    got, want = run_on(_gpu(), fn, *args), run_on(_cpu(), fn, *args)
    assert_same_bits(got, want, what, skip=skip)
    return got, want


def _calls_for(*fmts, tensor_amax=True):
    """The custom calls a public quantize of these formats must lower to on the GPU (under vmap the tensor amax is
    the reference's per-example reduction: tensor_amax=False)."""
    calls = {"jf4_quantize"}
    for f in fmts:
        if isinstance(f, NVFP4) and f.rht:
            calls.add("jf4_rht_amax")
        elif isinstance(f, NVFP4) and not f.local_1x64 and tensor_amax:
            calls.add("jf4_amax")
    return tuple(sorted(calls))


def _family(fmt):
    if isinstance(fmt, MXFP8):
        return "mx"
    return "1x64" if fmt.local_1x64 else "nv"


# ---- every format x orientation x dtype x shape ----------------------------------------------------------------------
# Shapes per format family, chosen so every family meets each situation: whole 128-row scale tiles ((256, 192)),
# rows % 128 != 0 ((320, 64): the swizzled padding rows), block axes that are not multiples of 64 where the format
# allows it (NVFP4 (80, 48) in both orientations, MXFP8 (96, 96); 1x64 needs both axes % 64), a rank-3 x (the middle
# axis: P > 1 in the kernel) and empty tensors.
SHAPES = {
    "nv": [(80, 48), (320, 64), (3, 64, 96), (0, 64), (64, 0)],
    "mx": [(96, 96), (320, 64), (3, 64, 96), (0, 64), (64, 0)],
    "1x64": [(64, 128), (320, 64), (2, 64, 128), (0, 64), (64, 0)],
}


def _matrix_cases():
    cases = []
    for i, fmt in enumerate(FORMATS):
        cases += [pytest.param(fmt, (256, 192), dt, id=f"{fmt!r}-(256, 192)-{dtype_id(dt)}") for dt in DTYPES]
        for j, shape in enumerate(SHAPES[_family(fmt)]):
            dt = DTYPES[(i + j) % 3]
            cases.append(pytest.param(fmt, shape, dt, id=f"{fmt!r}-{shape}-{dtype_id(dt)}"))
    return cases


def _axes(shape):
    """The orientations tested for x of `shape`: rowwise and columnwise of a matrix; middle and last of rank 3."""
    return (-1, 0) if len(shape) == 2 else (1, -1)


def _quantize_all(fmt, axes):
    """x, key -> {"axis=a": {"compact": QuantizedArray, "swizzled": QuantizedArray}} (paths name the failing case)."""
    def f(x, key):
        key = key if needs_key(fmt) else None
        return {f"axis={a}": {layout: jax_fp4.quantize(x, fmt, axis=a, key=key, scale_layout=layout)
                              for layout in ("compact", "swizzled")} for a in axes}
    return f


@pytest.mark.parametrize("fmt,shape,dtype", _matrix_cases())
def test_quantize_matches_reference(rng, fmt, shape, dtype):
    """Compact and swizzled scales, both orientations, edge values spliced into random inputs."""
    x = random_input(rng, shape, dtype)
    axes = _axes(shape)
    gpu_vs_cpu(_quantize_all(fmt, axes), x, KEY, present=_calls_for(fmt), what=f"{fmt!r} {dtype_id(dtype)}{shape}")


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
@pytest.mark.parametrize("scale_exp,dtype", [(-120, jnp.float32), (100, jnp.bfloat16)], ids=["2^-120", "2^100"])
def test_quantize_scaled_inputs(rng, fmt, scale_exp, dtype):
    """Inputs near the bottom (fp32 subnormal block amax, tensor scale clamped to FLT_MAX) and the top of the range."""
    x = random_input(rng, (128, 128), dtype, scale_exp=scale_exp)
    gpu_vs_cpu(_quantize_all(fmt, (-1, 0)), x, KEY, present=_calls_for(fmt), what=f"{fmt!r} x 2^{scale_exp}")


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_quantize_special_inputs(rng, fmt):
    """An all-zero tensor, a whole NaN block / tile / 1x64 window, and a tensor of infinities."""
    dtype = DTYPES[FORMATS.index(fmt) % 3]
    xs = special_inputs(rng, (128, 128), dtype)
    f = _quantize_all(fmt, (-1, 0))
    gpu_vs_cpu(lambda xs, key: {k: f(x, key) for k, x in xs.items()}, xs, KEY, present=_calls_for(fmt),
               what=f"{fmt!r} {dtype_id(dtype)}")


def test_2d_columnwise_p_gt_1_falls_back_to_reference(rng):
    """2D columnwise with P > 1 and K % 16 != 0 (16x16 tiles cross p) runs the reference, also on the GPU."""
    fmt = NVFP4(scaling_2d=True)
    x = random_input(rng, (2, 64, 8), jnp.bfloat16)
    assert not kernel_supports((2, 64, 8), None, fmt)
    gpu_vs_cpu(lambda x: jax_fp4.quantize(x, fmt, axis=1), x, present=(), absent=("jf4_quantize",))


# ---- quantize_rowwise_columnwise -------------------------------------------------------------------------------------
def _rc_cases():
    cases = []
    for i, pair in enumerate(PAIRS):
        for layout in ("compact", "swizzled"):
            shape = (256, 192) if layout == "compact" else (320, 64)
            dt = DTYPES[i % 3]
            cases.append(pytest.param(pair, shape, dt, layout, id=f"{pair_id(pair)}-{shape}-{dtype_id(dt)}-{layout}"))
    cases.append(pytest.param((NVFP4(), MXFP8()), (2, 160, 64), jnp.bfloat16, "swizzled",
                              id="rank3-NVFP4()-MXFP8()-(2, 160, 64)-bfloat16-swizzled"))
    return cases


@pytest.mark.parametrize("pair,shape,dtype,layout", _rc_cases())
def test_rowwise_columnwise_matches_reference(rng, pair, shape, dtype, layout):
    row_fmt, col_fmt = pair
    x = random_input(rng, shape, dtype)
    m, k = int(np.prod(shape[:-1])), shape[-1]

    def f(x, key):
        return jax_fp4.quantize_rowwise_columnwise(x, row_fmt, col_fmt, key=key, scale_layout=layout, dbias=True)

    got, want = gpu_vs_cpu(f, x, KEY, present=_calls_for(*[p for p in pair if p is not None]), skip=("[2]",),
                           what=f"{pair_id(pair)} {layout}")
    x2 = np.asarray(x, np.float32).reshape(m, k)
    assert_dbias_close(got[2], x2, "GPU dbias")
    assert_dbias_close(want[2], x2, "CPU dbias")

    # one kernel launch == the two separate quantize calls, on the GPU too
    def split(x, key):
        k0, k1 = jax.random.split(key)
        return (None if row_fmt is None else jax_fp4.quantize(x, row_fmt, axis=-1, key=k0, scale_layout=layout),
                None if col_fmt is None else jax_fp4.quantize(x.reshape(m, k), col_fmt, axis=0, key=k1,
                                                              scale_layout=layout))

    assert_same_bits(got[:2], run_on(_gpu(), split, x, KEY), "rowwise_columnwise vs separate calls (GPU)")


# ---- poisoned outputs: the kernel writes every byte of every output --------------------------------------------------
def _poison(s):
    """A buffer of s's shape and dtype with every bit set (float4: every nibble 0xF; f32: NaN bits)."""
    dt = jnp.dtype(s.dtype)
    if dt.name.startswith("float4"):
        return jax.lax.bitcast_convert_type(jnp.full(s.shape, 15, jnp.uint4), dt)
    if dt.itemsize == 1:
        return jax.lax.bitcast_convert_type(jnp.full(s.shape, 0xFF, jnp.uint8), dt)
    assert dt == jnp.float32, dt
    return jax.lax.bitcast_convert_type(jnp.full(s.shape, 0xFFFFFFFF, jnp.uint32), dt)


POISON_CASES = [  # (row_fmt, col_fmt, layout, x3 shape, dbias)
    (NVFP4(), NVFP4(), "compact", (1, 256, 192), True),
    (MXFP8(), MXFP8(), "swizzled", (1, 320, 64), True),  # rows % 128 != 0: the padding must be written as zeros
    (NVFP4(), MXFP8(), "swizzled", (1, 320, 64), True),  # mixed
    (NVFP4(), MXFP8(element="e5m2"), "compact", (1, 256, 192), False),
    (NVFP4(local_1x64=True), NVFP4(local_1x64=True), "compact", (1, 256, 192), False),
    (NVFP4(local_1x64=True), NVFP4(local_1x64=True), "swizzled", (1, 320, 64), True),
    (NVFP4(), NVFP4(), "swizzled", (3, 64, 96), True),  # P = 3, a different amax per p
    (None, MXFP8(), "swizzled", (2, 96, 64), False),
]


@pytest.mark.parametrize(
    "row_fmt,col_fmt,layout,shape,dbias", POISON_CASES,
    ids=[f"{c[0]!r}-{c[1]!r}-{c[2]}-{c[3]}-dbias{int(c[4])}" for c in POISON_CASES],
)
def test_poisoned_outputs_fully_written(rng, row_fmt, col_fmt, layout, shape, dbias):
    """Call the FFI target directly with its seven outputs aliased to poisoned buffers (extra operands 5..11)."""
    x3 = random_input(rng, shape, jnp.bfloat16)
    P = shape[0]
    amax = run_on(_cpu(), lambda x: reference.amax(x, axis=(1, 2)), x3)  # per p: the kernel indexes amax[p]
    amax_r = amax if isinstance(row_fmt, NVFP4) and not row_fmt.local_1x64 else np.zeros(P, np.float32)
    amax_c = amax if isinstance(col_fmt, NVFP4) and not col_fmt.local_1x64 else np.zeros(P, np.float32)
    zero_key = np.zeros(2, np.uint32)
    args = (x3, amax_r, amax_c, zero_key, zero_key)
    params = dict(row_fmt=row_fmt, col_fmt=col_fmt, scale_layout=layout, dbias=dbias)
    shapes = jax.eval_shape(functools.partial(quantize_3d, **params), *args)
    results = [jax.ShapeDtypeStruct(shapes[n].shape, shapes[n].dtype) for n in OUTPUT_NAMES]
    attrs = ffi_attributes(row_fmt, col_fmt, layout, dbias)
    call = jax.ffi.ffi_call("jf4_quantize", results, input_output_aliases={5 + i: i for i in range(7)})

    def poisoned(*args):
        return call(*args, *[_poison(r) for r in results], **attrs)

    assert ffi.HAS_CUDA_KERNELS, f"GPU test without the CUDA extension: {ffi.import_error()}"
    got = run_on(_gpu(), poisoned, *args)
    want = run_on(_cpu(), functools.partial(reference_outputs, **params), *args)
    assert len(got) == len(want) == 7
    for name, g, w in zip(OUTPUT_NAMES, got, want, strict=True):
        if name == "dbias" and dbias:
            assert_dbias_partials_close(g, x3)
        else:
            assert_leaf_bits(g, w, f"poisoned {name}")


# ---- stochastic rounding ---------------------------------------------------------------------------------------------
def test_stochastic_rounding_keys(rng):
    fmt = NVFP4(stochastic_rounding=True)
    x = random_input(rng, (256, 192), jnp.float32, edges=False)
    k1, k2 = jax.random.key(1), jax.random.key(2)

    def f(x, key):
        return jax_fp4.quantize(x, fmt, key=key), jax_fp4.quantize_rowwise_columnwise(x, fmt, fmt, key=key)[:2]

    a = run_on(_gpu(), f, x, k1)
    assert_same_bits(run_on(_gpu(), f, x, k1), a, "same key, second run")
    b = run_on(_gpu(), f, x, k2)
    for what, qa, qb in (("quantize", a[0], b[0]), ("rowwise", a[1][0], b[1][0]), ("columnwise", a[1][1], b[1][1])):
        diff = np.mean(bits(qa.data) != bits(qb.data))
        assert diff > 0.05, f"{what}: keys 1 and 2 give {diff:.1%} different codes"
        assert_leaf_bits(qa.scale, qb.scale, f"{what} scales do not depend on the key")
    gpu_vs_cpu(f, x, k2, present=("jf4_quantize",), what="SR key 2")


# ---- transformations: jit, eager, vmap, scan -------------------------------------------------------------------------
VMAP_CASES = [  # (format, axis, layout, keys); compact + unbatched keys fold the batch into P (the kernel runs)
    (NVFP4(), -1, "compact", None),
    (MXFP8(), 0, "compact", None),
    (NVFP4(rht=True), 0, "compact", None),
    (NVFP4(stochastic_rounding=True), -1, "compact", "batched"),
    (NVFP4(stochastic_rounding=True), -1, "compact", "shared"),
    (MXFP8(element="e5m2"), -1, "swizzled", None),
]


def _vmap_param(fmt, axis, layout, keys):
    return pytest.param(fmt, axis, layout, keys, id=f"{fmt!r}-{axis}-{layout}-{keys}", marks=vmap_marks(keys, layout))


@pytest.mark.parametrize("fmt,axis,layout,keys", [_vmap_param(*c) for c in VMAP_CASES])
def test_vmap(rng, fmt, axis, layout, keys):
    """GPU vmap == CPU (reference) vmap == the per-example GPU calls."""
    B = 3
    xb = random_input(rng, (B, 128, 64), jnp.bfloat16)
    ks = jax.random.split(KEY, B)
    key = KEY if keys == "shared" else None

    def one(x, k):
        return jax_fp4.quantize(x, fmt, axis=axis, key=k if keys == "batched" else key, scale_layout=layout)

    def f(xb, ks):
        return jax.vmap(one)(xb, ks)

    # The batch rule folds the batch into the kernel's P only for compact scales without stochastic rounding
    # (per-example SR streams restart at counter 0); the other cases map the reference.
    sr = isinstance(fmt, NVFP4) and fmt.stochastic_rounding
    folded = keys != "batched" and layout == "compact" and not sr
    got, _ = gpu_vs_cpu(f, xb, ks, present=_calls_for(fmt, tensor_amax=False) if folded else (), what=f"vmap {fmt!r}")
    per_example = [run_on(_gpu(), one, xb[i], ks[i]) for i in range(B)]
    assert_same_bits(got, jax.tree.map(lambda *a: np.stack(a), *per_example), "vmap vs per-example (GPU)")


def test_scan_jit_and_eager(rng):
    fmt_a, fmt_b = NVFP4(), MXFP8()
    xs = random_input(rng, (3, 128, 64), jnp.bfloat16)

    def body(c, x):
        row, col, _ = jax_fp4.quantize_rowwise_columnwise(x, fmt_a, fmt_b, scale_layout="swizzled")
        return c, (jax_fp4.quantize(x, fmt_a, axis=0), row, col)

    def scan(xs):
        return jax.lax.scan(body, None, xs)[1]

    got, _ = gpu_vs_cpu(scan, xs, what="scan")
    for i in range(xs.shape[0]):  # each scan step == a plain jit call on that slice
        assert_same_bits(jax.tree.map(lambda a, i=i: a[i], got), run_on(_gpu(), lambda x: body(None, x)[1], xs[i]),
                         f"scan slice {i}")
    xg = jax.device_put(xs[0], _gpu())  # eager: the primitive's impl rule compiles it alone, on the GPU
    eager = jax.device_get(jax_fp4.quantize(xg, fmt_a, axis=0))
    assert_same_bits(eager, jax.tree.map(lambda a: a[0], got[0]), "eager vs scan")


# ---- XLA command buffers (CUDA graphs) -------------------------------------------------------------------------------
def test_command_buffers(rng):
    """Quantize inside jit three times with XLA command buffers capturing the custom calls (CUDA graphs), in a
    subprocess (XLA_FLAGS is read when the backend starts); its bits must be the CPU reference's every time."""
    assert_command_buffer_runs(command_buffer_input, command_buffer_workload, int(rng.integers(2**31)),
                               ("jf4_quantize",))


# ---- rht_amax --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(4, 64, 96), (1, 272, 208)], ids=str)
def test_rht_amax(rng, shape, dtype):
    x3 = random_input(rng, shape, dtype)
    if shape[0] > 1:
        x3[1] = 0  # an all-zero p
        x3[2] = np.nan  # an all-NaN p
        x3[3] = random_input(rng, shape[1:], dtype, scale_exp=-120)  # tiny: flushed in the RHT

    def f(x3):
        return rht_amax(x3, "row"), rht_amax(x3, "col")

    got, _ = gpu_vs_cpu(f, x3, present=("jf4_rht_amax",), what="rht_amax (row, col)")
    assert got[0].shape == (shape[0],) and got[0].dtype == np.float32


# ---- stochastic rounding of one shard (the sharding rule's per-shard call) ------------------------------------------
def test_stochastic_rounding_shard_stream(rng):
    """A shard x[1:3, 64:128, 48:144] of x[4, 128, 192] quantized with its stream words (`reference.sr.shard_words`:
    what jf4_quantize's sharding rule passes each shard) draws the global stream: kernel == reference, and == the
    matching slice of the global quantize (same amax), rowwise ([P, M, K]) and columnwise ([P, K, M])."""
    fmt, fmt_rht = NVFP4(stochastic_rounding=True), NVFP4(stochastic_rounding=True, rht=True)
    G, off = (4, 128, 192), (1, 64, 48)
    sl = tuple(slice(o, o + n) for o, n in zip(off, (2, 64, 96), strict=True))
    xg = random_input(rng, G, jnp.bfloat16, edges=False)
    amax = np.full(G[0], np.max(np.abs(xg.astype(np.float32))), np.float32)
    kr, kc = (reference.sr.philox_key(k) for k in jax.random.split(KEY))
    wr = reference.sr.shard_words(kr, off, G)
    wc = reference.sr.shard_words(kc, (off[0], off[2], off[1]), (G[0], G[2], G[1]))

    def f(x, amax, key_row, key_col):
        o = quantize_3d(x, amax, amax, key_row, key_col, row_fmt=fmt, col_fmt=fmt_rht)
        return o["row_data"], o["row_scale"], o["col_data"], o["col_scale"]

    got, _ = gpu_vs_cpu(f, xg[sl], amax[sl[0]], wr, wc, what="SR shard stream")
    glob = run_on(_gpu(), f, xg, amax, kr, kc)
    p, m, k = sl
    want = (glob[0][p, m, k], glob[1][p, m, k.start // 16:k.stop // 16], glob[2][p, k, m],
            glob[3][p, k, m.start // 16:m.stop // 16])
    for name, g, w in zip(("row_data", "row_scale", "col_data", "col_scale"), got, want, strict=True):
        assert_leaf_bits(g, w, f"shard vs global slice: {name}")
