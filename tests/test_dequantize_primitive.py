"""`jax_fp4.dequantize` through the `jf4_dequantize` primitive (CPU: its reference lowering).

* public dequantize == `jax_fp4.reference.dequantize` (+ `reference.unswizzle_scales`) bit for bit, for every format
  x orientation (any axis, rank 3) x scale layout x output dtype, shapes with tails and padding, empty tensors;
* arbitrary codes (every E4M3 / E8M0 scale code, NaN included; zero / inf / tiny tensor amax);
* vmap (the batch folded into P, swizzled scales unswizzled by jf4_unswizzle), jit, eager, eval_shape;
* the primitive's trace-time errors.
The CUDA kernel against these bits: tests/test_dequantize_kernels.py (gpu marker).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _quantize_util import assert_leaf_bits, random_input

import jax_fp4
from jax_fp4 import MXFP8, NVFP4, reference
from jax_fp4._src.primitives.dequantize import dequantize_3d, dequantize_array, dequantize_p
from jax_fp4.reference import codes

FORMATS = [NVFP4(), NVFP4(scaling_2d=True), NVFP4(rht=True), NVFP4(local_1x64=True), MXFP8(), MXFP8(element="e5m2")]
OUT = [jnp.float32, jnp.bfloat16, jnp.float16]
KEY = jax.random.key(7)


def reference_dequantize(q, dtype):
    """The reference path the public function used before (compact scales first)."""
    scale = q.scale
    if q.scale_layout == "swizzled":
        scale = reference.unswizzle_scales(q.scale, q.fmt, q.compact_scale_shape(), q.axis)
    return reference.dequantize(q.data, scale, q.amax, q.window_amax, q.fmt, q.axis, dtype)


def _cases(fmt):
    """(shape, axis, layout, out dtype) covering, per format: rowwise and columnwise, rank 3 (middle and first axis:
    P > 1), swizzle padding rows (160, 192 % 128 != 0) and padding scale columns (3 / 5 / 7 columns), MXFP8 columnwise
    with C % 16 != 0 (the kernel's partial segments), empty tensors; every output dtype."""
    f32, bf16, f16 = jnp.float32, jnp.bfloat16, jnp.float16
    if isinstance(fmt, NVFP4) and fmt.local_1x64:
        return [((192, 128), -1, "swizzled", bf16), ((192, 128), 0, "compact", f32), ((2, 64, 128), 1, "swizzled", f16),
                ((64, 192), -1, "compact", f16), ((0, 64), 0, "swizzled", bf16)]
    if isinstance(fmt, NVFP4):
        cases = [((160, 48), -1, "swizzled", bf16), ((80, 112), 0, "swizzled", f32), ((32, 16, 48), 1, "compact", f16),
                 ((32, 16, 48), 0, "swizzled", bf16), ((96, 64), 0, "compact", bf16), ((0, 64), -1, "compact", f32)]
        return cases if not (fmt.rht or fmt.scaling_2d) else cases[1:4]  # 2D / RHT: the same geometry as 1D
    return [((160, 96), -1, "swizzled", bf16), ((96, 96), 0, "swizzled", f16), ((64, 40), 0, "compact", f32),
            ((32, 64, 96), 1, "swizzled", f32), ((32, 64, 96), 0, "compact", bf16), ((64, 224), -1, "compact", f16),
            ((64, 0), 0, "swizzled", bf16)]


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_public_dequantize_equals_reference(rng, fmt):
    cases = _cases(fmt)
    xs = [jnp.asarray(random_input(rng, c[0], jnp.float32)) for c in cases]
    qs = jax.jit(lambda xs: [jax_fp4.quantize(x, fmt, axis=a, scale_layout=lay)
                             for x, (_, a, lay, _) in zip(xs, cases, strict=True)])(xs)
    got, want = jax.jit(lambda qs: ([jax_fp4.dequantize(q, c[3]) for q, c in zip(qs, cases, strict=True)],
                                    [reference_dequantize(q, c[3]) for q, c in zip(qs, cases, strict=True)]))(qs)
    for g, w, (shape, axis, layout, dt) in zip(got, want, cases, strict=True):
        assert g.shape == shape and g.dtype == dt
        assert_leaf_bits(g, w, f"{fmt!r} {shape} axis={axis} {layout} {jnp.dtype(dt).name}")


def _random_codes(q, rng):
    """q with random codes in every field: data, every scale code (NaN included), amaxes (0, tiny, inf, ...).

    Window amaxes are zero or normal fp32: a subnormal one is read as zero by the reference under XLA:CPU's
    denormals-are-zero fusions but not eagerly (quantize never stores one beside a nonzero block scale)."""
    nv = isinstance(q.fmt, NVFP4)
    d = rng.integers(0, 16 if nv else 256, q.data.shape, dtype=np.uint32)
    s = rng.integers(0, 256, q.scale.shape, dtype=np.uint32)
    amax = None if q.amax is None else jnp.float32(rng.choice([0.0, 1e-40, 3.5, 2688.0, 1e30, np.inf]))
    w = None
    if q.window_amax is not None:
        w = jnp.asarray(rng.choice(np.array([0, 1e-13, 0.7, 5e3, 3e38], np.float32), q.window_amax.shape))
    return jax_fp4.QuantizedArray(codes.to_dtype(jnp.asarray(d), q.data.dtype),
                                  codes.to_dtype(jnp.asarray(s), q.scale.dtype), amax, w, fmt=q.fmt, axis=q.axis,
                                  scale_layout=q.scale_layout)


def test_arbitrary_codes_equal_reference(rng):
    """Every format, both layouts and orientations, random codes in every field, all output dtypes."""
    qs = []
    for i, fmt in enumerate(FORMATS):
        layout, axis = ("compact", -1) if i % 2 else ("swizzled", 0)
        qs.append(_random_codes(jax_fp4.quantize(jnp.zeros((192, 128)), fmt, axis=axis, scale_layout=layout), rng))
    got, want = jax.jit(lambda qs: ([jax_fp4.dequantize(q, OUT[i % 3]) for i, q in enumerate(qs)],
                                    [reference_dequantize(q, OUT[i % 3]) for i, q in enumerate(qs)]))(qs)
    for q, g, w in zip(qs, got, want, strict=True):
        assert_leaf_bits(g, w, f"{q!r} random codes")


@pytest.mark.parametrize("fmt,axis,layout", [(NVFP4(), 1, "compact"), (NVFP4(local_1x64=True), 0, "swizzled"),
                                              (MXFP8(), 1, "swizzled"), (MXFP8(element="e5m2"), -1, "compact")],
                         ids=str)
def test_vmap_equals_per_example(rng, fmt, axis, layout):
    """vmap folds the batch into P (one amax per example, P > 1 for axis 1 of a rank-3 x); swizzled scales go
    through jf4_unswizzle first."""
    xb = jnp.asarray(random_input(rng, (3, 64, 128), jnp.float32))
    if axis == 1:
        xb = xb.reshape(3, 16, 64, 8)
    qb = jax.vmap(lambda x: jax_fp4.quantize(x, fmt, axis=axis, scale_layout=layout))(xb)
    f = jax.vmap(lambda q: jax_fp4.dequantize(q, jnp.bfloat16))
    text = str(jax.make_jaxpr(f)(qb))
    assert "jf4_dequantize" in text and ("jf4_unswizzle" in text) == (layout == "swizzled"), text
    got = jax.jit(f)(qb)
    for i in range(xb.shape[0]):
        qi = jax.tree.map(lambda a, i=i: a[i], qb)
        assert_leaf_bits(got[i], reference_dequantize(qi, jnp.bfloat16), f"vmap example {i}")


def test_vmap_unbatched_scale_and_in_axes(rng):
    """Batched data with shared (unbatched) scales and amax, and a batch on axis 1 of the data."""
    fmt = NVFP4()
    q = jax_fp4.quantize(jnp.asarray(random_input(rng, (32, 64), jnp.float32)), fmt)
    datas = jnp.stack([q.data, q.data[::-1]], axis=1)  # [32, 2, 64]

    def one(d):
        return jax_fp4.dequantize(jax_fp4.QuantizedArray(d, q.scale, q.amax, None, fmt=fmt, axis=-1))

    got = jax.vmap(one, in_axes=1)(datas)
    for i in range(2):
        want = reference.dequantize(datas[:, i], q.scale, q.amax, None, fmt, -1)
        assert_leaf_bits(got[i], want, f"in_axes=1 example {i}")


def test_eager_jit_and_eval_shape(rng):
    q = jax_fp4.quantize(jnp.asarray(random_input(rng, (2, 48, 32), jnp.bfloat16)), NVFP4(rht=True), axis=1)
    eager = jax_fp4.dequantize(q, jnp.bfloat16)
    assert_leaf_bits(eager, jax.jit(jax_fp4.dequantize, static_argnums=1)(q, jnp.bfloat16), "eager vs jit")
    s = jax.eval_shape(lambda q: jax_fp4.dequantize(q, jnp.float16), q)
    assert s.shape == (2, 48, 32) and s.dtype == jnp.float16


def test_empty_launches_nothing_and_has_the_shape():
    for fmt, shape, axis in ((NVFP4(), (0, 64), -1), (MXFP8(), (64, 0), 0), (NVFP4(), (0, 64), 0)):
        q = jax_fp4.quantize(jnp.zeros(shape), fmt, axis=axis, scale_layout="swizzled")
        out = jax.jit(jax_fp4.dequantize)(q)
        assert out.shape == shape and out.dtype == jnp.float32


# ---- the primitive's checks ------------------------------------------------------------------------------------------
def _mx(shape=(1, 4, 32)):
    return jnp.zeros(shape, jnp.float8_e4m3fn)


def _e8(shape):
    return jnp.zeros(shape, jnp.float8_e8m0fnu)


@pytest.mark.parametrize("call,match", [
    (lambda: dequantize_3d(_mx(), _e8((1, 4, 2)), None, None, fmt=MXFP8(), out_dtype=jnp.float32),
     r"scale \(compact\) must be float8_e8m0fnu\[1, 4, 1\], got float8_e8m0fnu\[1, 4, 2\]"),
    (lambda: dequantize_3d(_mx(), _e8((1, 4, 1)), None, None, fmt=MXFP8(), out_dtype=jnp.int8),
     "output dtype must be float32, bfloat16 or float16"),
    (lambda: dequantize_3d(_mx(), _e8((1, 4, 1)), None, None, fmt=MXFP8(), out_dtype=jnp.float32,
                           mx_columnwise=True), r"block axis \(R = 4\) is not a whole number of 32-blocks"),
    (lambda: dequantize_3d(_mx((4, 32)), _e8((4, 1)), None, None, fmt=MXFP8(), out_dtype=jnp.float32),
     r"data float8_e4m3fn\[4, 32\].*expected rank 3"),
    (lambda: dequantize_3d(_mx(), _e8((1, 4, 1)), jnp.ones((1,)), None, fmt=NVFP4(), out_dtype=jnp.float32),
     "data must be float4_e2m1fn"),
    (lambda: dequantize_3d(_mx(), jnp.zeros((1, 4, 1), jnp.uint8), None, None, fmt=MXFP8(), out_dtype=jnp.float32),
     "scale .* must be float8_e8m0fnu"),
    (lambda: dequantize_3d(_mx(), _e8((4, 4)), None, None, fmt=MXFP8(), out_dtype=jnp.float32,
                           scale_layout="swizzled"), r"scale \(swizzled\) must be float8_e8m0fnu\[128, 4\]"),
    (lambda: dequantize_3d(_mx(), _e8((1, 4, 1)), None, None, fmt=MXFP8(), out_dtype=jnp.float32,
                           scale_layout="padded"), "scale_layout must be one of"),
    (lambda: dequantize_3d(_mx(), _e8((1, 4, 1)), None, None, fmt=MXFP8(), out_dtype=jnp.float32,
                           transpose_out=True), "transpose_out is for NVFP4"),
    (lambda: dequantize_3d(jnp.zeros((1, 4, 32), jnp.float4_e2m1fn), jnp.zeros((1, 4, 2), jnp.float8_e4m3fn),
                           None, None, fmt=NVFP4(), out_dtype=jnp.float32), r"amax must be float32\[1\] or"),
    (lambda: dequantize_3d(jnp.zeros((1, 4, 32), jnp.float4_e2m1fn), jnp.zeros((1, 4, 2), jnp.float8_e4m3fn),
                           jnp.zeros((3,)), None, fmt=NVFP4(), out_dtype=jnp.float32), r"amax must be float32\[1\]"),
    (lambda: dequantize_3d(jnp.zeros((1, 4, 32), jnp.float4_e2m1fn), jnp.zeros((1, 4, 2), jnp.float8_e4m3fn),
                           None, None, fmt=NVFP4(local_1x64=True), out_dtype=jnp.float32), "whole number of 64-blocks"),
    (lambda: dequantize_3d(jnp.zeros((1, 4, 64), jnp.float4_e2m1fn), jnp.zeros((1, 4, 4), jnp.float8_e4m3fn),
                           None, jnp.zeros((1, 4, 2)), fmt=NVFP4(local_1x64=True), out_dtype=jnp.float32),
     r"window_amax must be float32\[1, 4, 1\]"),
    (lambda: dequantize_3d(_mx(), _e8((1, 4, 1)), jnp.ones(()), None, fmt=MXFP8(), out_dtype=jnp.float32),
     r"amax \(unused by this format\) must be float32\[0\]"),
])
def test_abstract_eval_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_public_errors_name_the_problem():
    q = jax_fp4.quantize(jnp.ones((4, 32)), NVFP4())
    with pytest.raises(ValueError, match="QuantizedArray"):
        jax_fp4.dequantize(q.data)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        jax.jit(lambda q: jax_fp4.dequantize(q, jnp.int32))(q)


def test_grad_is_zero_as_before():
    """stop_gradient semantics (the reference's integer-exact arithmetic gave zero derivatives too)."""
    q = jax_fp4.quantize(jnp.ones((4, 32)), NVFP4(), scale_layout="swizzled")

    def f(a):
        qa = jax_fp4.QuantizedArray(q.data, q.scale, a, None, fmt=q.fmt, axis=-1, scale_layout="swizzled")
        return jnp.sum(jax_fp4.dequantize(jax_fp4.unswizzle_scales(qa)))

    assert float(jax.grad(f)(q.amax)) == 0.0


def test_dequantize_array_is_the_public_path():
    q = jax_fp4.quantize(jnp.ones((32, 4)), MXFP8(), axis=0)
    jaxpr = jax.make_jaxpr(jax_fp4.dequantize)(q)
    assert [e.primitive for e in jaxpr.jaxpr.eqns if e.primitive is dequantize_p], jaxpr
    assert_leaf_bits(dequantize_array(q), jax_fp4.dequantize(q), "dequantize_array")


@pytest.mark.parametrize("fmt", [NVFP4(), NVFP4(scaling_2d=True), NVFP4(rht=True)], ids=repr)
@pytest.mark.parametrize("axis,layout", [(-1, "compact"), (0, "swizzled"), (1, "compact")])
def test_block_scales_only_is_the_gemm_operand(rng, fmt, axis, layout):
    """An empty amax operand (NVFP4 1D/2D/RHT) gives value(q) * s_b in q's logical orientation, no tensor scale and no
    inverse RHT: `gemm.exact_operand`, computed here independently from the codes (exact in float64)."""
    from jax_fp4.gemm import exact_operand

    x = random_input(rng, (32, 64, 48), jnp.float32)
    q = jax_fp4.quantize(x, fmt, axis=axis, scale_layout=layout)
    v, ts = jax.jit(exact_operand)(q)
    assert ts.dtype == jnp.float32 and ts.shape == ()
    c = jax_fp4.unswizzle_scales(q)
    vals = np.asarray(codes.e2m1_value(codes.from_dtype(c.data)), np.float64)
    vals = vals.reshape(*vals.shape[:-1], -1, 16) * np.asarray(c.scale.astype(jnp.float32), np.float64)[..., None]
    want = np.moveaxis(vals.reshape(c.data.shape), -1, axis)
    assert v.dtype == jnp.bfloat16 and v.shape == q.shape
    np.testing.assert_array_equal(np.asarray(v, np.float64), want)
