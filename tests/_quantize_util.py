"""Helpers shared by tests/test_quantize_ops.py and tests/test_quantize_kernels.py (no expectations computed here).

Imported as a top-level module: pytest's default "prepend" import mode puts tests/ (no __init__.py) on sys.path.
"""

from __future__ import annotations

import functools
import hashlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # ReferenceOnlyWarning on a machine without the CUDA extension
    import jax_fp4
from jax_fp4 import MXFP8, NVFP4

#: Every format family, for parametrizations.
FORMATS = [
    NVFP4(),
    NVFP4(scaling_2d=True),
    NVFP4(rht=True),
    NVFP4(stochastic_rounding=True),
    NVFP4(local_1x64=True),
    MXFP8(),
    MXFP8(element="e5m2"),
]

#: rowwise/columnwise format pairs of `quantize_rowwise_columnwise`.
PAIRS = [
    (NVFP4(), NVFP4()),
    (MXFP8(), MXFP8()),
    (NVFP4(), MXFP8()),  # the NVFP4-forward / MXFP8-backward recipe
    (NVFP4(scaling_2d=True), NVFP4(scaling_2d=True)),
    (NVFP4(), NVFP4(rht=True)),
    (NVFP4(stochastic_rounding=True), NVFP4(stochastic_rounding=True)),
    (NVFP4(local_1x64=True), NVFP4(local_1x64=True)),
    (None, MXFP8(element="e5m2")),
    (MXFP8(), None),
]

#: Values at the edges of the formats' ranges (zeros, fp32 subnormals, E2M1 grid points and ties, the E4M3/E5M2
#: maxima, infinities, near FLT_MAX), spliced into random inputs. No NaN: a NaN makes an NVFP4 tensor's carried amax
#: NaN and its whole dequantize NaN (docs/numerics.md s6), which would hide the decode of every other
#: value; NaN inputs are covered by `special_inputs` ("nan_block") and the edge tables.
EDGE = np.array(
    [0.0, -0.0, 1e-40, -3e-39, 1.17e-38, 2.5e-36, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 448.0, 57344.0,
     np.inf, -np.inf, 3.0e38, -1e-45, 7.0e-36],
    np.float32,
)

U = 2.0**-24  # unit roundoff of fp32


def fmt_id(f) -> str:
    return repr(f)


def pair_id(p) -> str:
    return f"{p[0]!r}-{p[1]!r}"


def dtype_id(d) -> str:
    return jnp.dtype(d).name


# ---- inputs ----------------------------------------------------------------------------------------------------------
def random_input(rng, shape, dtype, *, scale_exp=0, edges=True) -> np.ndarray:
    """numpy `dtype` array: standard normal * 2**scale_exp, with EDGE values spliced in at random positions."""
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(2.0**scale_exp)
    flat = x.reshape(-1)
    if edges and flat.size:
        pos = rng.choice(flat.size, size=min(flat.size, 3 * EDGE.size), replace=False)
        flat[pos] = np.resize(EDGE, pos.size)
    with np.errstate(over="ignore"):
        return x.astype(dtype)


def special_inputs(rng, shape, dtype) -> dict[str, np.ndarray]:
    """An all-zero tensor, a random one with a whole 64x64 NaN square (a whole block / tile / 1x64 window in every
    orientation) and one of random-signed infinities."""
    nan_block = rng.standard_normal(shape).astype(np.float32)
    nan_block[:64, :64] = np.nan
    inf = np.where(rng.random(shape) < 0.5, -np.inf, np.inf).astype(np.float32)
    return {"zeros": np.zeros(shape, dtype), "nan_block": nan_block.astype(dtype), "inf": inf.astype(dtype)}


# ---- bit comparison --------------------------------------------------------------------------------------------------
def bits(a) -> np.ndarray:
    """Unsigned-integer bit patterns of an array (float4: the 4-bit code, NaN and -0 kept)."""
    a = np.asarray(jax.device_get(a))
    dt = a.dtype
    if dt.itemsize == 1:
        b = a.view(np.uint8)
        return b & np.uint8(0xF) if dt.name.startswith("float4") else b
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[dt.itemsize])


def _value(a, i):
    try:
        return float(np.asarray(a).reshape(-1)[i].astype(np.float32))
    except (TypeError, ValueError):
        return np.asarray(a).reshape(-1)[i]


def assert_leaf_bits(got, want, what="") -> None:
    """Same shape, dtype and bits; on failure report (DeepGEMM-style) the first mismatching flat index and codes."""
    g, w = np.asarray(jax.device_get(got)), np.asarray(jax.device_get(want))
    assert g.dtype == w.dtype, f"{what}: dtype {g.dtype} != {w.dtype}"
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    gb, wb = bits(g).reshape(-1), bits(w).reshape(-1)
    bad = np.flatnonzero(gb != wb)
    if bad.size:
        i = int(bad[0])
        width = 2 * max(1, g.dtype.itemsize)
        raise AssertionError(
            f"{what} ({g.dtype}{list(g.shape)}): {bad.size} of {gb.size} differ; first at flat index {i} "
            f"{tuple(int(v) for v in np.unravel_index(i, g.shape))}: got code 0x{int(gb[i]):0{width}x} "
            f"({_value(g, i)}), want 0x{int(wb[i]):0{width}x} ({_value(w, i)})"
        )


def assert_same_bits(got, want, what="", *, skip=()) -> None:
    """Pytrees with the same structure (static fields included) and bit-identical leaves.

    skip: leaf path substrings (jax.tree_util.keystr) to leave out of the bit comparison (e.g. "dbias").
    """
    gs, ws = jax.tree.structure(got), jax.tree.structure(want)
    assert gs == ws, f"{what}: tree structure differs:\n got  {gs}\n want {ws}"
    gl = jax.tree_util.tree_flatten_with_path(got)[0]
    wl = jax.tree.leaves(want)
    for (path, g), w in zip(gl, wl, strict=True):
        name = jax.tree_util.keystr(path)
        if any(s in name for s in skip):
            continue
        assert_leaf_bits(g, w, f"{what}{name}")


def bits_hash(tree) -> str:
    """sha256 over every leaf's dtype, shape and bits (for comparing results across processes)."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        a = np.asarray(jax.device_get(leaf))
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(bits(a)).tobytes())
    return h.hexdigest()


# ---- dbias -----------------------------------------------------------------------------------------------------------
def assert_dbias_close(got, x, what="dbias") -> None:
    """got: float32[K] (or [..., K] partial sums of x over its leading rows) vs the exact float64 column sums.

    Bound: any fp32 summation of M terms (whatever the order: 64-row stripes then the stripes, pairwise, ...) has
    |fl(sum) - sum| <= gamma_{M-1} * sum|x_i| with gamma_n = n*u / (1 - n*u), u = 2**-24 (Higham, Accuracy and
    Stability of Numerical Algorithms, 2nd ed., eq. 4.4; each term passes through at most M-1 roundings), i.e.
    (M-1) * 2**-24 * sum|x| to first order. The bf16/f16 -> fp32 widening of the inputs is exact. Columns with a
    NaN (or both infinities) must give NaN, with one infinity that infinity; columns whose sum|x| exceeds FLT_MAX
    (the fp32 sum may overflow depending on the order) are not checked, nor are the infinite or NaN results of the
    columns whose finite terms alone may overflow (one infinity plus an fp32 overflow of the opposite sign gives NaN).
    """
    xf = np.asarray(x, np.float64)
    m = xf.shape[0]
    got = np.asarray(got)
    assert got.dtype == np.float32 and got.shape == xf.shape[1:], f"{what}: {got.dtype}{got.shape}"
    with np.errstate(invalid="ignore", over="ignore"):
        exact = xf.sum(axis=0)
        absum = np.abs(xf).sum(axis=0)
    n = max(m - 1, 0)
    bound = n * U / (1 - n * U) * absum
    g = got.astype(np.float64)
    nan_col = np.isnan(exact)
    with np.errstate(over="ignore"):
        may_overflow = np.where(np.isfinite(xf), np.abs(xf), 0.0).sum(axis=0) > np.finfo(np.float32).max
    assert np.all(np.isnan(g[nan_col])), f"{what}: NaN columns differ: got {np.flatnonzero(np.isnan(g))}"
    assert not np.any(np.isnan(g[~nan_col & ~may_overflow])), (
        f"{what}: NaN columns differ: got {np.flatnonzero(np.isnan(g))}, want {np.flatnonzero(nan_col)}")
    inf_col = np.isinf(exact) & ~nan_col & ~may_overflow
    assert np.array_equal(g[inf_col], exact[inf_col]), f"{what}: infinite columns differ"
    ok = np.isfinite(exact) & (absum <= np.finfo(np.float32).max)
    with np.errstate(invalid="ignore"):
        err = np.abs(g - exact)
    bad = np.flatnonzero(ok & ~(err <= bound))
    assert bad.size == 0, (
        f"{what}: {bad.size} columns outside the fp32 summation bound; first {bad[0]}: got {g[bad[0]]!r}, "
        f"exact {exact[bad[0]]!r}, |err| {err[bad[0]]:.3g} > bound {bound[bad[0]]:.3g}"
    )


def assert_dbias_partials_close(got, x3, rows=64, what="dbias partials") -> None:
    """got: float32[P, ceil(M/rows), K], the per-stripe column sums of x3 [P, M, K]."""
    P, M, K = x3.shape
    t = -(-M // rows)
    got = np.asarray(got)
    assert got.shape == (P, t, K), f"{what}: shape {got.shape} != {(P, t, K)}"
    xf = np.asarray(x3, np.float32)
    for p in range(P):
        for s in range(t):
            assert_dbias_close(got[p, s], xf[p, s * rows:(s + 1) * rows], f"{what}[{p}, {s}]")


# ---- jitted entry points (one compilation per shape and format, shared by the tests of a module) ---------------------
@functools.partial(jax.jit, static_argnames=("fmt", "axis", "scale_layout"))
def jquantize(x, fmt, axis=-1, key=None, scale_layout="compact"):
    return jax_fp4.quantize(x, fmt, axis=axis, key=key, scale_layout=scale_layout)


@functools.partial(jax.jit, static_argnames=("row_fmt", "col_fmt", "scale_layout", "dbias"))
def jquantize_rc(x, row_fmt, col_fmt, key=None, scale_layout="compact", dbias=False):
    return jax_fp4.quantize_rowwise_columnwise(x, row_fmt, col_fmt, key=key, scale_layout=scale_layout, dbias=dbias)


def needs_key(*fmts) -> bool:
    return any(isinstance(f, NVFP4) and f.stochastic_rounding for f in fmts)


def jq(x, fmt, axis=-1, key=None, scale_layout="compact"):
    """`jquantize` with the key dropped for formats that ignore it (so those share one compilation)."""
    return jquantize(x, fmt, axis, key if needs_key(fmt) else None, scale_layout)


def split_quantize(x, row_fmt, col_fmt, key, scale_layout="compact", quantize=jq):
    """The separate calls `quantize_rowwise_columnwise` promises to equal: (row, col) QuantizedArrays or None."""
    k0, k1 = jax.random.split(key)
    x2 = x.reshape(-1, x.shape[-1])
    row = None if row_fmt is None else quantize(x, row_fmt, -1, k0, scale_layout)
    col = None if col_fmt is None else quantize(x2, col_fmt, 0, k1, scale_layout)
    return row, col


# ---- the command-buffer workload (run in a subprocess by test_quantize_kernels.py and on the CPU by the test) --------
def command_buffer_input(seed: int) -> np.ndarray:
    return random_input(np.random.default_rng(seed), (320, 192), jnp.bfloat16)


def command_buffer_workload(x):
    """NVFP4 row+col, MXFP8 row+col (swizzled) and the mixed NVFP4-row / MXFP8-col call (no dbias: not bit-exact)."""
    qrc = jax_fp4.quantize_rowwise_columnwise
    return (qrc(x, NVFP4(), NVFP4()), qrc(x, MXFP8(), MXFP8(), scale_layout="swizzled"), qrc(x, NVFP4(), MXFP8()))


def vmap_marks(keys, layout) -> list:
    """Marks of a vmap case (none: the known batch-rule bugs are fixed)."""
    return []
