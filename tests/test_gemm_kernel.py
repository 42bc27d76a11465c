"""The Hopper block-scaled GEMM kernel (`jf4_gemm` FFI target, cpp/gemm/) called directly through `jax.ffi.ffi_call`.

Operands are quantized with `jax_fp4.quantize` and shipped as raw codes; the GPU function rebuilds the float4 /
float8 arrays and calls the target. Each result is compared with a float64 product of the exactly decoded operands
(`_gemm_util.decode`) within the kernel's bound (`_gemm_util.kernel_gemm_bound`, derived in the `_gemm_util` module
docstring): every product value(q) * s_b times value(q) * s_b is exact (<= 12 significant bits); the tensor cores'
fp32 accumulation (aligned and truncated per MMA step, Fasi et al.; RNE is covered) costs at most 4 units of u per
term, gamma_(4K); NVFP4 1x64 pairs add at most 4 for the window decode factors (the kernel rounds
fa = RN(1 / S_enc,a), tmp * fa and fb = RN(1 / S_enc,b), and adds tmp * fa * fb with one fma: 3); each NVFP4 tensor
scale adds two roundings; then the fp32 bias addition and the cast to bfloat16 (`cast_bound`).
out_amax must equal max |out| of the written output bit for bit, and be NaN when an output is NaN.

Marked `gpu`; skipped unless the default device is a compute capability 9.x GPU and the extension exports jf4_gemm.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cmd_buffer_util import assert_command_buffer_runs
from _gemm_util import cast_bound, decode, kernel_gemm_bound, tensor_scale_roundings
from _quantize_util import bits_hash

import jax_fp4
from jax_fp4 import MXFP8, NVFP4
from jax_fp4._src import ffi
from jax_fp4._src.ffi_codes import GemmFlag, Kind
from jax_fp4.reference import codes

pytestmark = pytest.mark.gpu

TARGET = "jf4_gemm"


@pytest.fixture(autouse=True, scope="module")
def _hopper():
    dev = jax.devices()[0]
    cc = str(getattr(dev, "compute_capability", ""))
    if dev.platform != "gpu" or not cc.startswith("9."):
        pytest.skip(f"jf4_gemm runs on compute capability 9.x only (device {dev}, compute capability {cc!r})")
    assert ffi.HAS_CUDA_KERNELS, f"GPU test without the CUDA extension: {ffi.import_error()}"
    assert TARGET in ffi.targets(), f"the CUDA extension has no {TARGET} target: {ffi.targets()}"


def _cpu():
    return jax.devices("cpu")[0]


def _kind(fmt) -> int:
    if isinstance(fmt, NVFP4):
        return int(Kind.NVFP4)
    return int(Kind.MXFP8_E5M2 if fmt.element == "e5m2" else Kind.MXFP8_E4M3)


@functools.cache
def _quantizer(fmt):
    """jit: x -> raw leaves of quantize(x, fmt) (uint8 codes, float32 amaxes: no float4 array crosses the host)."""
    def f(x):
        q = jax_fp4.quantize(x, fmt, axis=-1)
        raw = {"data": codes.from_dtype(q.data).astype(jnp.uint8), "scale": codes.from_dtype(q.scale).astype(jnp.uint8)}
        if fmt.local_1x64:
            raw["aux"] = q.window_amax
        elif isinstance(fmt, NVFP4):
            raw["aux"] = q.amax.reshape(())
        else:
            raw["aux"] = jnp.zeros((0,), jnp.float32)
        return raw
    return jax.jit(f)


def quantize_raw(x, fmt):
    """x [R, K] -> (QuantizedArray on the CPU, its raw leaves {data, scale: uint8 codes; aux: float32} as numpy).

    Quantized on the default device (the CUDA quantize kernels, bit for bit the reference's; the GEMM is checked
    against this very QuantizedArray, decoded exactly, so the check does not depend on them)."""
    raw = {k: np.asarray(v) for k, v in jax.device_get(_quantizer(fmt)(jnp.asarray(x))).items()}
    with jax.default_device(_cpu()):
        q = jax_fp4.QuantizedArray(
            codes.to_dtype(jnp.asarray(raw["data"], jnp.uint32), fmt.data_dtype),
            codes.to_dtype(jnp.asarray(raw["scale"], jnp.uint32), fmt.scale_dtype),
            jnp.asarray(raw["aux"]) if fmt.has_tensor_amax else None,
            jnp.asarray(raw["aux"]) if fmt.local_1x64 else None, fmt=fmt, axis=-1, scale_layout="compact")
    return q, raw


def gemm_fn(fa, fb, out_dtype, emit_amax: bool):
    """f(raw_a, raw_b, bias) -> (out [M, N], out_amax []) through jf4_gemm."""
    flags = (GemmFlag.A_LOCAL_1X64 if fa.local_1x64 else 0) | (GemmFlag.B_LOCAL_1X64 if fb.local_1x64 else 0)
    flags |= GemmFlag.EMIT_AMAX if emit_amax else 0

    def f(ra, rb, bias):
        ops = []
        for r, fmt in ((ra, fa), (rb, fb)):
            ops += [codes.to_dtype(r["data"].astype(jnp.uint32), fmt.data_dtype),
                    codes.to_dtype(r["scale"].astype(jnp.uint32), fmt.scale_dtype), r["aux"]]
        m, n = ra["data"].shape[0], rb["data"].shape[0]
        results = (jax.ShapeDtypeStruct((m, n), out_dtype), jax.ShapeDtypeStruct((), jnp.float32))
        call = jax.ffi.ffi_call(TARGET, results)
        return call(*ops, bias, a_kind=np.int32(_kind(fa)), b_kind=np.int32(_kind(fb)), flags=np.int32(int(flags)))
    return jax.jit(f)


def run_gemm(ra, fa, rb, fb, bias, out_dtype=jnp.float32, emit_amax=True):
    fn = gemm_fn(fa, fb, out_dtype, emit_amax)
    gpu = jax.devices()[0]
    args = jax.device_put((ra, rb, bias), gpu)
    assert f"custom_call @{TARGET}" in fn.lower(*args).as_text()
    out, amax = jax.device_get(fn(*args))
    return np.asarray(out), np.asarray(amax)


def reference(qa, qb, bias, out_dtype):
    """(float64 reference, bound) of out = qa . qb^T + bias (module docstring)."""
    with jax.default_device(_cpu()):
        a, b = decode(qa), decode(qb)
    ref, absprod = a @ b.T, np.abs(a) @ np.abs(b).T
    bound = kernel_gemm_bound(absprod, a.shape[1], window=qa.fmt.local_1x64, scale=tensor_scale_roundings(qa, qb))
    if bias is not None and bias.size:
        ref = ref + bias.astype(np.float64)
    return ref, cast_bound(ref, bound, out_dtype, added_in_f32=bias is not None and bias.size > 0)


def assert_within(got, ref, bound, what):
    g = np.asarray(got, np.float64)
    assert g.shape == ref.shape, f"{what}: shape {g.shape} != {ref.shape}"
    assert np.all(np.isfinite(g)), f"{what}: {int(np.sum(~np.isfinite(g)))} non-finite outputs"
    ratio = np.abs(g - ref) / np.maximum(bound, np.finfo(np.float64).tiny)
    i = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    assert ratio[i] <= 1.0, (f"{what}: {int(np.sum(ratio > 1))} of {ratio.size} outside the bound; worst at {i}: "
                             f"got {g[i]!r}, reference {ref[i]!r}, bound {bound[i]:.3g}")


def assert_amax(out, amax, what):
    want = np.max(np.abs(np.asarray(out, np.float32)))
    assert np.asarray(amax, np.float32).tobytes() == np.float32(want).tobytes(), (
        f"{what}: out_amax {amax!r} != max |out| {want!r}")


def random_x(rng, shape):
    """Normal values with a spread of row / column magnitudes (several block scales, no overflow)."""
    x = rng.standard_normal(shape).astype(np.float32)
    return x * np.exp2(rng.integers(-3, 4, (shape[0], 1))).astype(np.float32)


PAIRS = {
    "nvfp4xnvfp4": (NVFP4(), NVFP4()),
    "e4m3xe4m3": (MXFP8(), MXFP8()),
    "e4m3xe5m2": (MXFP8(), MXFP8(element="e5m2")),
    "e5m2xe4m3": (MXFP8(element="e5m2"), MXFP8()),
    "1x64x1x64": (NVFP4(local_1x64=True), NVFP4(local_1x64=True)),
    "nvfp4xe4m3": (NVFP4(), MXFP8()),
    "e5m2xnvfp4": (MXFP8(element="e5m2"), NVFP4()),
}
# (M, N, K): edge tiles in M and N (1, 33, 200), K not a multiple of the 64-wide K-tile (96, 160), several tiles and
# K-tiles (the two-stage pipeline), and K % 32 == 16 for NVFP4 (a half-filled 32-code run). 1x64 needs M, N, K % 64.
SHAPES = [(200, 33, 256), (1, 200, 96), (33, 1, 160), (300, 260, 1024)]
SHAPES_1X64 = [(64, 192, 192), (192, 64, 1024), (320, 256, 512)]


def _shapes(pair):
    fa, fb = PAIRS[pair]
    if fa.local_1x64:
        return SHAPES_1X64
    if isinstance(fa, NVFP4) and isinstance(fb, NVFP4):
        return SHAPES + [(130, 129, 80)]
    return SHAPES


@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_product_within_bound(rng, pair, out_dtype):
    """Every shape without and with a bias: the output within the bound, out_amax exact."""
    fa, fb = PAIRS[pair]
    for m, n, k in _shapes(pair):
        qa, ra = quantize_raw(random_x(rng, (m, k)), fa)
        qb, rb = quantize_raw(random_x(rng, (n, k)), fb)
        for bias in (np.zeros((0,), np.float32), rng.standard_normal(n).astype(np.float32)):
            out, amax = run_gemm(ra, fa, rb, fb, bias, out_dtype)
            assert out.dtype == jnp.dtype(out_dtype)
            ref, bound = reference(qa, qb, bias, out_dtype)
            what = f"{pair} {m}x{n}x{k} {jnp.dtype(out_dtype).name} bias={bool(bias.size)}"
            assert_within(out, ref, bound, what)
            assert_amax(out, amax, what)


def raw_mxfp8(rng, rows, k, fmt, e_range):
    """(QuantizedArray on the CPU, raw leaves) of an MXFP8 operand with uniformly random codes (every finite code:
    zeros, subnormals, both signs; NaN / Inf codes become zero) and E8M0 scale codes uniform in e_range."""
    data = rng.integers(0, 256, (rows, k), dtype=np.uint8)
    special = (data & 0x7F) == 0x7F if fmt.element == "e4m3" else (data & 0x7C) == 0x7C
    data[special] = 0
    raw = {"data": data, "scale": rng.integers(e_range[0], e_range[1] + 1, (rows, k // 32), dtype=np.uint8),
           "aux": np.zeros((0,), np.float32)}
    with jax.default_device(_cpu()):
        q = jax_fp4.QuantizedArray(codes.to_dtype(jnp.asarray(raw["data"], jnp.uint32), fmt.data_dtype),
                                   codes.to_dtype(jnp.asarray(raw["scale"], jnp.uint32), fmt.scale_dtype),
                                   None, None, fmt=fmt, axis=-1, scale_layout="compact")
    return q, raw


@pytest.mark.parametrize("pair", ["e4m3xe4m3", "e4m3xe5m2", "e5m2xe4m3"])
def test_mxfp8_every_code_and_scale(rng, pair):
    """Uniform random codes under block scales on both sides of the decode's fast-path limits (E4M3 e <= 134, E5M2
    e <= 142; blocks above them, and blocks with a NaN / Inf code, take the general decode), all operand values normal
    in bfloat16: the output within the bound. Then one NaN / Inf code in row 5 of A: that row's NaN and Inf outputs
    are the reference's, every other row unchanged."""
    fa, fb = PAIRS[pair]
    for m, n, k in [(200, 136, 256), (72, 40, 96)]:
        qa, ra = raw_mxfp8(rng, m, k, fa, (100, 160))
        qb, rb = raw_mxfp8(rng, n, k, fb, (60, 140))
        out, amax = run_gemm(ra, fa, rb, fb, np.zeros((0,), np.float32))
        ref, bound = reference(qa, qb, None, jnp.float32)
        assert_within(out, ref, bound, f"{pair} {m}x{n}x{k}")
        assert_amax(out, amax, f"{pair} {m}x{n}x{k}")
        special = {**ra, "data": ra["data"].copy()}
        special["data"][5, k - 7] = 0x7F if fa.element == "e4m3" else 0xFC  # NaN / -Inf
        with jax.default_device(_cpu()):
            qs = jax_fp4.QuantizedArray(codes.to_dtype(jnp.asarray(special["data"], jnp.uint32), fa.data_dtype),
                                        qa.scale, None, None, fmt=fa, axis=-1, scale_layout="compact")
        got, _ = run_gemm(special, fa, rb, fb, np.zeros((0,), np.float32))
        with np.errstate(invalid="ignore", over="ignore"):
            want, _ = reference(qs, qb, None, jnp.float32)
        np.testing.assert_array_equal(np.isnan(got[5]), np.isnan(want[5]))
        np.testing.assert_array_equal(got[5][np.isinf(want[5])], want[5][np.isinf(want[5])])
        assert np.array_equal(np.delete(got, 5, 0), np.delete(out, 5, 0))


def test_bound_rejects_a_wrong_product(rng):
    """The bound is tight enough to see one code's worth of error: the product with one A element's code changed
    (the next E4M3 magnitude) lies outside it."""
    fa = fb = MXFP8()
    qa, ra = quantize_raw(random_x(rng, (64, 128)), fa)
    qb, rb = quantize_raw(random_x(rng, (64, 128)), fb)
    bad = {**ra, "data": ra["data"].copy()}
    k = int(np.flatnonzero(((bad["data"][5] & 0x7F) > 0x08) & ((bad["data"][5] & 0x7F) < 0x7E))[0])  # a normal code
    bad["data"][5, k] += 1  # the next magnitude, same sign
    out, _ = run_gemm(bad, fa, rb, fb, np.zeros((0,), np.float32))
    ref, bound = reference(qa, qb, None, jnp.float32)
    assert np.any(np.abs(out.astype(np.float64) - ref) > bound)


def test_amax_not_emitted_leaves_result_alone(rng):
    fa = fb = NVFP4()
    _, ra = quantize_raw(random_x(rng, (40, 64)), fa)
    _, rb = quantize_raw(random_x(rng, (24, 64)), fb)
    out, _ = run_gemm(ra, fa, rb, fb, np.zeros((0,), np.float32), emit_amax=False)
    out2, amax = run_gemm(ra, fa, rb, fb, np.zeros((0,), np.float32), emit_amax=True)
    assert out.tobytes() == out2.tobytes()
    assert_amax(out2, amax, "emit_amax")


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_nan_propagates(rng, out_dtype):
    """A NaN code (E4M3 0x7F) in row 3 of A makes row 3 of the output NaN and out_amax NaN; a NaN block scale
    (E8M0 0xFF) of row 70 of B makes column 70 NaN; every other output stays within the bound."""
    fa = fb = MXFP8()
    m, n, k = 130, 140, 192
    qa, ra = quantize_raw(random_x(rng, (m, k)), fa)
    qb, rb = quantize_raw(random_x(rng, (n, k)), fb)
    ra = {**ra, "data": ra["data"].copy()}
    rb = {**rb, "scale": rb["scale"].copy()}
    ra["data"][3, 100] = 0x7F
    rb["scale"][70, 2] = 0xFF
    out, amax = run_gemm(ra, fa, rb, fb, np.zeros((0,), np.float32), out_dtype)
    o = np.asarray(out, np.float64)
    assert np.all(np.isnan(o[3, :])) and np.all(np.isnan(o[:, 70]))
    rows, cols = np.arange(m) != 3, np.arange(n) != 70
    ref, bound = reference(qa, qb, None, out_dtype)
    assert_within(o[rows][:, cols], ref[rows][:, cols], bound[rows][:, cols], "NaN-free outputs")
    assert np.isnan(amax), f"out_amax {amax!r} with NaN outputs"
    assert np.asarray(amax, np.float32).view(np.uint32) == 0x7FC00000  # canonical NaN


def test_rejects_bad_calls(rng):
    """Mismatched contracting sizes, a 1x64 operand paired with a non-1x64 one and a wrong scale shape are FFI errors
    naming the problem."""
    fa = fb = NVFP4()
    _, ra = quantize_raw(random_x(rng, (16, 64)), fa)
    _, rb = quantize_raw(random_x(rng, (16, 128)), fb)
    with pytest.raises(Exception, match="contracting sizes differ"):
        run_gemm(ra, fa, rb, fb, np.zeros((0,), np.float32))
    _, rb = quantize_raw(random_x(rng, (16, 64)), fb)
    bad = {**ra, "scale": ra["scale"][:, :2]}
    with pytest.raises(Exception, match="a_scale must be the compact"):
        run_gemm(bad, fa, rb, fb, np.zeros((0,), np.float32))
    fl = NVFP4(local_1x64=True)
    _, rl = quantize_raw(random_x(rng, (64, 64)), fl)
    with pytest.raises(Exception, match="1x64 operands pair only"):
        run_gemm(rl, fl, rb, fb, np.zeros((0,), np.float32))


# ---- XLA command buffers (CUDA graphs) -------------------------------------------------------------------------------
_CMD_CASES = [(NVFP4(), NVFP4(), (200, 136, 256), jnp.bfloat16), (MXFP8(), MXFP8(element="e5m2"), (96, 64, 160),
                                                                    jnp.float32),
              (NVFP4(local_1x64=True), NVFP4(local_1x64=True), (128, 192, 256), jnp.bfloat16)]


def command_buffer_args(seed):
    rng = np.random.default_rng(seed)
    args = []
    for fa, fb, (m, n, k), _ in _CMD_CASES:
        args.append((quantize_raw(random_x(rng, (m, k)), fa)[1], quantize_raw(random_x(rng, (n, k)), fb)[1],
                     rng.standard_normal(n).astype(np.float32)))
    return args


def command_buffer_workload(args):
    outs = []
    for (fa, fb, _, dt), (ra, rb, bias) in zip(_CMD_CASES, args, strict=True):
        out, amax = gemm_fn(fa, fb, dt, True)(ra, rb, bias)
        outs += [out, amax]
    return outs


def test_command_buffers(rng):
    """jf4_gemm (memset of out_amax + one launch) inside jit three times with XLA command buffers capturing it (CUDA
    graphs), in a subprocess: the bits must equal a run without command buffers (the kernel is deterministic: a fixed
    summation order, and the amax is a maximum)."""
    seed = int(rng.integers(2**31))
    gpu = jax.devices()[0]
    want = bits_hash(jax.device_get(jax.jit(command_buffer_workload)(jax.device_put(command_buffer_args(seed), gpu))))
    assert_command_buffer_runs(command_buffer_args, command_buffer_workload, seed, (TARGET,), expected=want)
