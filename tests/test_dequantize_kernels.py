"""The CUDA dequantize and scale-layout kernels (`jf4_dequantize`, `jf4_swizzle`, `jf4_unswizzle`) vs the reference.

QuantizedArrays are made on the CPU (the reference quantize) and shipped as raw codes (uint8), so these tests run
only the kernels under test; each test runs the same jitted function on the GPU (its HLO must hold the custom calls,
so a test cannot silently pass on the reference) and on the CPU device (the reference lowering) and compares bits,
reporting the first differing flat index and both codes.

All tests are marked `gpu` (skipped where jax's default backend is not a GPU). Replay a failure with the session seed
printed in the pytest header: JAX_FP4_SEED=<seed>.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cmd_buffer_util import assert_command_buffer_runs
from _quantize_util import assert_leaf_bits, assert_same_bits, random_input, special_inputs

import jax_fp4
from jax_fp4 import MXFP8, NVFP4
from jax_fp4._src import ffi
from jax_fp4._src.primitives import dequantize as dq
from jax_fp4._src.primitives.swizzle import BYTE_DTYPES, padded_shape, swizzle, unswizzle
from jax_fp4.gemm import exact_operand
from jax_fp4.reference import codes

pytestmark = pytest.mark.gpu

FORMATS = [NVFP4(), NVFP4(scaling_2d=True), NVFP4(rht=True), NVFP4(local_1x64=True), MXFP8(), MXFP8(element="e5m2")]
OUT = [jnp.float32, jnp.bfloat16, jnp.float16]


def _gpu():
    return jax.devices("gpu")[0]


def _cpu():
    return jax.devices("cpu")[0]


def assert_custom_calls(fn, args, present):
    assert ffi.HAS_CUDA_KERNELS, f"GPU test without the CUDA extension: {ffi.import_error()}"
    text = jax.jit(fn).lower(*jax.device_put(args, _gpu())).as_text()
    for name in present:
        assert re.search(rf"custom_call\s*@{name}\b", text), f"no {name} custom call in the GPU HLO:\n{text[:20000]}"


def run_on(device, fn, *args):
    return jax.device_get(jax.jit(fn)(*jax.device_put(args, device)))


def gpu_vs_cpu(fn, *args, present=("jf4_dequantize",), what=""):
    assert_custom_calls(fn, args, present)
    got, want = run_on(_gpu(), fn, *args), run_on(_cpu(), fn, *args)
    assert_same_bits(got, want, what)
    return got


# ---- QuantizedArrays as raw codes ------------------------------------------------------------------------------------
def _raw(q):
    """QuantizedArray -> its leaves as uint8 codes and float32 amaxes (no float4 array crosses the host)."""
    raw = {"data": codes.from_dtype(q.data).astype(jnp.uint8), "scale": codes.from_dtype(q.scale).astype(jnp.uint8)}
    if q.amax is not None:
        raw["amax"] = q.amax
    if q.window_amax is not None:
        raw["window_amax"] = q.window_amax
    return raw


def quantize_raw(x, fmt, axis, layout):
    """Quantize on the CPU (the reference) -> (raw leaves as numpy, static template for `from_raw`)."""
    raw = run_on(_cpu(), lambda x: _raw(jax_fp4.quantize(x, fmt, axis=axis, scale_layout=layout)), x)
    return raw, (fmt, fmt.normalize_axis(np.shape(x), axis), layout)


def from_raw(raw, template):
    fmt, axis, layout = template
    return jax_fp4.QuantizedArray(codes.to_dtype(raw["data"].astype(jnp.uint32), fmt.data_dtype),
                                  codes.to_dtype(raw["scale"].astype(jnp.uint32), fmt.scale_dtype), raw.get("amax"),
                                  raw.get("window_amax"), fmt=fmt, axis=axis, scale_layout=layout)


def dequantize_all(templates, dtypes):
    """raws -> {case: dequantize(q, dtype)} for every template and dtype (one jitted function)."""
    def f(raws):
        return {f"{i}:{jnp.dtype(d).name}": jax_fp4.dequantize(from_raw(r, t), d)
                for i, (r, t) in enumerate(zip(raws, templates, strict=True)) for d in dtypes}
    return f


# ---- every format x layout x output dtype x shape -------------------------------------------------------------------
# Per family: rows % 128 != 0 (swizzle padding rows), 3 / 5 / 7 scale columns (padding columns), tails (C % 64 != 0),
# rank 3 on the middle and first axes (P > 1; NVFP4: the transposed output), MXFP8 columnwise with C % 16 != 0 (the
# kernel's partial segments), R % 8 != 0 in the NVFP4 transposed output (16-byte unaligned rows: scalar stores),
# empty tensors.
SHAPES = {
    "nv": [((160, 48), (-1, 0)), ((80, 112), (-1, 0)), ((64, 36), (0,)), ((2, 48, 64), (1, -1)), ((0, 64), (-1, 0)),
           ((64, 0), (0,))],
    "mx": [((160, 96), (-1, 0)), ((64, 40), (0,)), ((2, 64, 96), (1, -1)), ((96, 224), (-1,)), ((0, 64), (-1,)),
           ((64, 0), (0,))],
    "1x64": [((192, 128), (-1, 0)), ((64, 192), (-1,)), ((2, 64, 128), (1,)), ((0, 64), (-1, 0))],
}


def _family(fmt):
    if isinstance(fmt, MXFP8):
        return "mx"
    return "1x64" if fmt.local_1x64 else "nv"


@pytest.mark.parametrize("layout", ["compact", "swizzled"])
@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_dequantize_matches_reference(rng, fmt, layout):
    raws, templates = [], []
    for shape, axes in SHAPES[_family(fmt)]:
        x = random_input(rng, shape, jnp.float32)
        for axis in axes:
            if getattr(fmt, "scaling_2d", False) and math.prod(shape) // max(shape[axis], 1) % 16:
                continue  # 2D scaling needs the non-block axes % 16 == 0 as well (quantize raises)
            r, t = quantize_raw(x, fmt, axis, layout)
            raws.append(r)
            templates.append(t)
    gpu_vs_cpu(dequantize_all(templates, OUT), raws, what=f"{fmt!r} {layout}")


@pytest.mark.parametrize("fmt", [NVFP4(), NVFP4(scaling_2d=True), NVFP4(rht=True), NVFP4(local_1x64=True), MXFP8()],
                         ids=repr)
def test_exact_operand(rng, fmt):
    """`gemm.exact_operand` (the GEMM emulation's operands: NVFP4 1D/2D/RHT through jf4_dequantize's block-scales-only
    mode, value * s_b with no tensor scale and no inverse RHT) on the kernel == on the reference."""
    raws, templates = [], []
    for shape, axes in (((192, 128), (-1, 0)), ((2, 64, 128), (1, -1))):
        x = random_input(rng, shape, jnp.float32)
        for axis in axes:
            for layout in ("compact", "swizzled"):
                r, t = quantize_raw(x, fmt, axis, layout)
                raws.append(r)
                templates.append(t)

    def f(raws):
        return {str(i): exact_operand(from_raw(r, t))[0] for i, (r, t) in enumerate(zip(raws, templates, strict=True))}

    gpu_vs_cpu(f, raws, what=f"exact_operand {fmt!r}")


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_edge_inputs(rng, fmt):
    """Zeros, a whole NaN block / 1x64 window, infinities, inputs near the bottom (2^-120: subnormal block amax,
    tensor scale clamped) and the top (2^100) of the range, edge values spliced in (E8M0 codes 0 / 1 / 0xFD / 0xFE,
    E4M3 / E5M2 maxima, ties)."""
    xs = list(special_inputs(rng, (128, 128), np.float32).values())
    xs += [random_input(rng, (128, 128), np.float32, scale_exp=-120), random_input(rng, (128, 128), np.float32,
                                                                                    scale_exp=100)]
    raws, templates = [], []
    for i, x in enumerate(xs):
        r, t = quantize_raw(x, fmt, (-1, 0)[i % 2], ("compact", "swizzled")[i % 2])
        raws.append(r)
        templates.append(t)
    gpu_vs_cpu(dequantize_all(templates, OUT), raws, what=f"{fmt!r} edge inputs")


def test_arbitrary_codes(rng):
    """Random codes in every field: all 256 scale codes (E4M3 and E8M0 NaN included), every data code, tensor amax
    0 / subnormal / inf / huge, window amax 0 / normal / NaN (a subnormal one is read as zero by the CPU reference
    inside XLA:CPU's denormals-are-zero fusions; quantize never stores one beside a nonzero block scale)."""
    raws, templates = [], []
    for i, fmt in enumerate(FORMATS):
        for axis, layout in ((-1, "swizzled"), (0, "compact")):
            r, t = quantize_raw(np.zeros((192, 128), np.float32), fmt, axis, layout)
            r["data"] = rng.integers(0, 16 if isinstance(fmt, NVFP4) else 256, r["data"].shape).astype(np.uint8)
            r["scale"] = rng.integers(0, 256, r["scale"].shape).astype(np.uint8)
            if "amax" in r:
                r["amax"] = np.float32([0.0, 1e-40, np.inf, 3e38, 2688.0, 0.5][(i + axis) % 6])
            if "window_amax" in r:
                r["window_amax"] = rng.choice(np.float32([0, 1e-13, 0.7, 5e3, 3e38, np.nan]), r["window_amax"].shape)
            raws.append(r)
            templates.append(t)
    gpu_vs_cpu(dequantize_all(templates, OUT), raws, what="random codes")


# ---- poisoned outputs: the kernels write every element --------------------------------------------------------------
def _poison(shape, dtype):
    dt = jnp.dtype(dtype)
    u = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[dt.itemsize]
    return jax.lax.bitcast_convert_type(jnp.full(shape, jnp.iinfo(u).max, u), dt)


POISON_CASES = [  # (format, x shape, axis, layout, out dtype)
    (NVFP4(), (160, 48), -1, "compact", jnp.bfloat16),
    (NVFP4(rht=True), (80, 42), 0, "swizzled", jnp.float32),  # transposed output, R = 42: unaligned rows
    (NVFP4(local_1x64=True), (192, 128), -1, "swizzled", jnp.float16),
    (MXFP8(), (64, 40), 0, "compact", jnp.float16),  # C = 40: partial segments
    (MXFP8(element="e5m2"), (2, 64, 96), 1, "swizzled", jnp.bfloat16),
]


@pytest.mark.parametrize("fmt,shape,axis,layout,dtype", POISON_CASES,
                         ids=[f"{c[0]!r}-{c[1]}-{c[2]}-{c[3]}-{jnp.dtype(c[4]).name}" for c in POISON_CASES])
def test_poisoned_output_fully_written(rng, fmt, shape, axis, layout, dtype):
    """Call the FFI target directly with its output aliased to a poisoned buffer (extra operand 4)."""
    raw, t = quantize_raw(random_input(rng, shape, np.float32), fmt, axis, layout)

    def poisoned(raw):
        args, params = dq.dequantize_operands(from_raw(raw, t), dtype)
        out = jax.eval_shape(functools.partial(dq.dequantize_p.bind, **params), *args)
        call = jax.ffi.ffi_call("jf4_dequantize", jax.ShapeDtypeStruct(out.shape, out.dtype),
                                input_output_aliases={4: 0})
        flags = dq.flags(fmt, params["scale_layout"], params["mx_columnwise"], params["transpose_out"])
        return call(*args, _poison(out.shape, out.dtype), kind=np.int32(dq.kind(fmt)), flags=np.int32(flags))

    def reference(raw):
        args, params = dq.dequantize_operands(from_raw(raw, t), dtype)
        return dq.reference_dequantize(*args, **params)

    assert ffi.HAS_CUDA_KERNELS, f"GPU test without the CUDA extension: {ffi.import_error()}"
    assert_leaf_bits(run_on(_gpu(), poisoned, raw), run_on(_cpu(), reference, raw), f"poisoned {fmt!r} {shape}")


def test_amax_per_p_and_poisoned_swizzle(rng):
    """The vmap-folded amax (one per p) through the FFI, and swizzle / unswizzle into poisoned buffers (the swizzle
    kernel writes the padding as zeros)."""
    B = 3
    xb = random_input(rng, (B, 64, 96), np.float32)
    raws = [quantize_raw(xb[i], NVFP4(), 0, "compact") for i in range(B)]

    def f(rs):
        qb = jax.tree.map(lambda *a: jnp.stack(a), *[from_raw(r, raws[0][1]) for r in rs])
        return jax.vmap(lambda q: jax_fp4.dequantize(q, jnp.bfloat16))(qb)

    gpu_vs_cpu(f, [r for r, _ in raws], what="amax per p")

    s = rng.integers(0, 256, (2, 200, 7)).astype(np.uint8)
    rp, cp = padded_shape(200, 7)

    def poisoned(s):
        sw = jax.ffi.ffi_call("jf4_swizzle", jax.ShapeDtypeStruct((2, rp, cp), jnp.uint8),
                              input_output_aliases={1: 0})(s, _poison((2, rp, cp), jnp.uint8))
        back = jax.ffi.ffi_call("jf4_unswizzle", jax.ShapeDtypeStruct(s.shape, jnp.uint8),
                                input_output_aliases={1: 0})(sw, _poison(s.shape, jnp.uint8))
        return sw, back

    got = run_on(_gpu(), poisoned, s)
    assert_leaf_bits(got[0], run_on(_cpu(), swizzle, s), "poisoned swizzle")
    assert_leaf_bits(got[1], s, "poisoned unswizzle")


# ---- swizzle / unswizzle ---------------------------------------------------------------------------------------------
def test_swizzle_unswizzle_match_reference(rng):
    """Every byte dtype, leading batch dimensions, padding rows and columns, more than one 64-column stripe, empty."""
    shapes = [(3, 2), (128, 4), (130, 5), (2, 320, 70), (1, 1), (256, 132), (0, 4), (5, 0), (2, 0, 3)]
    ss = [rng.integers(0, 256, s).astype(np.uint8) for s in shapes]

    def f(ss):
        out = {}
        for i, s in enumerate(ss):
            for dt in BYTE_DTYPES:
                t = s if dt == jnp.uint8 else jax.lax.bitcast_convert_type(s, dt)
                sw = swizzle(t)
                out[f"{i}:{dt.name}"] = (sw, unswizzle(sw, *s.shape[-2:]))
        return out

    got = gpu_vs_cpu(f, ss, present=("jf4_swizzle", "jf4_unswizzle"), what="swizzle")
    for i, s in enumerate(ss):
        assert_leaf_bits(got[f"{i}:uint8"][1], s, f"unswizzle(swizzle(s)) {s.shape}")


def test_public_scale_layouts_jit_eager_vmap(rng):
    """swizzle_scales / unswizzle_scales under jit and vmap (GPU == CPU), and eager on the GPU."""
    raw, t = quantize_raw(random_input(rng, (3, 96, 130), np.float32), MXFP8(), 1, "compact")

    def f(raw):
        q = from_raw(raw, t)
        s = jax_fp4.swizzle_scales(q)
        vq = jax.tree.map(lambda a: jnp.stack([a, a]), q)
        return s.scale, jax_fp4.unswizzle_scales(s).scale, jax.vmap(jax_fp4.swizzle_scales)(vq).scale

    got = gpu_vs_cpu(f, raw, present=("jf4_swizzle", "jf4_unswizzle"), what="public scale layouts")
    assert_leaf_bits(got[1], from_raw(raw, t).scale, "round trip")
    qg = jax.device_put(from_raw(raw, t), _gpu())
    assert_leaf_bits(jax_fp4.swizzle_scales(qg).scale, got[0], "eager")


# ---- transformations -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,axis,layout", [(NVFP4(rht=True), 0, "swizzled"), (MXFP8(), 0, "compact")], ids=str)
def test_vmap_and_eager(rng, fmt, axis, layout):
    """vmap folds the batch into P (swizzled scales unswizzled by the kernel first); == per-example GPU calls."""
    xb = random_input(rng, (3, 64, 96), np.float32)
    raws = [quantize_raw(xb[i], fmt, axis, layout) for i in range(3)]
    t = raws[0][1]

    def f(rs):
        qb = jax.tree.map(lambda *a: jnp.stack(a), *[from_raw(r, t) for r in rs])
        return jax.vmap(lambda q: jax_fp4.dequantize(q, jnp.float16))(qb)

    present = ("jf4_dequantize", "jf4_unswizzle") if layout == "swizzled" else ("jf4_dequantize",)
    got = gpu_vs_cpu(f, [r for r, _ in raws], present=present, what=f"vmap {fmt!r}")
    for i, (r, _) in enumerate(raws):
        qg = jax.device_put(from_raw(r, t), _gpu())
        assert_leaf_bits(jax_fp4.dequantize(qg, jnp.float16), got[i], f"eager example {i}")


# ---- XLA command buffers (CUDA graphs) -------------------------------------------------------------------------------
def command_buffer_args(seed):
    rng = np.random.default_rng(seed)
    return [quantize_raw(random_input(rng, shape, np.float32), fmt, axis, layout)[0]
            for fmt, shape, axis, layout in _CMD_CASES]


_CMD_CASES = [(NVFP4(), (320, 192), 0, "swizzled"), (MXFP8(), (320, 192), -1, "compact"),
              (NVFP4(local_1x64=True), (128, 192), -1, "compact")]


def command_buffer_workload(raws):
    qs = [from_raw(r, (fmt, fmt.normalize_axis(shape, axis), layout))
          for r, (fmt, shape, axis, layout) in zip(raws, _CMD_CASES, strict=True)]
    return (jax_fp4.dequantize(qs[0], jnp.bfloat16), jax_fp4.dequantize(qs[1]), jax_fp4.dequantize(qs[2], jnp.float16),
            jax_fp4.unswizzle_scales(qs[0]).scale, jax_fp4.swizzle_scales(qs[1]).scale)


def test_command_buffers(rng):
    """Dequantize / swizzle / unswizzle inside jit three times with XLA command buffers capturing the custom calls
    (CUDA graphs), in a subprocess (XLA_FLAGS is read when the backend starts); the bits must be the CPU reference's."""
    assert_command_buffer_runs(command_buffer_args, command_buffer_workload, int(rng.integers(2**31)),
                               ("jf4_dequantize", "jf4_swizzle", "jf4_unswizzle"))
