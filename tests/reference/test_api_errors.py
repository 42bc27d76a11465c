"""Input validation of the public API: ValueErrors at trace time (eagerly, under jax.jit and under eval_shape)
that name the shape and the format, and the format specs' value semantics (frozen, hashable, static args)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jax_fp4

from ._util import quantize

NV, MX = jax_fp4.NVFP4(), jax_fp4.MXFP8()

# (format, shape, dtype, axis, words the message must contain besides the shape and the format's repr)
BAD_INPUTS = [
    (NV, (4, 32), jnp.int32, -1, ["int32"]),
    (MX, (4, 64), jnp.bool_, -1, ["bool"]),
    (NV, (4, 32), jnp.float64 if jax.config.jax_enable_x64 else jnp.int8, -1, ["bfloat16, float16 or float32"]),
    (NV, (4, 17), jnp.float32, -1, ["17", "16"]),
    (NV, (17, 4), jnp.float32, 0, ["17", "16"]),
    (MX, (4, 48), jnp.float32, -1, ["48", "32"]),
    (MX, (48, 4), jnp.bfloat16, 0, ["48", "32"]),
    (jax_fp4.NVFP4(local_1x64=True), (64, 32), jnp.float32, -1, ["64"]),  # block axis 32: a 16- but not 64-multiple
    (jax_fp4.NVFP4(local_1x64=True), (32, 64), jnp.float32, -1, ["64"]),  # the other axis is not a 64-multiple
    (jax_fp4.NVFP4(scaling_2d=True), (8, 32), jnp.float32, -1, ["16"]),   # 2D: rows % 16 != 0
    (jax_fp4.NVFP4(scaling_2d=True), (32, 24), jnp.float32, 0, ["16"]),   # columnwise 2D: K = 24 rows of x.T
    (NV, (), jnp.float32, -1, ["rank-0"]),
    (MX, (64,), jnp.float32, 1, ["axis"]),                                # axis out of range
    (NV, (4, 32), jnp.float32, -3, ["axis"]),
]


def _ids(case):
    fmt, shape, dtype, axis, _ = case
    return f"{fmt!r}-{shape}-{jnp.dtype(dtype).name}-{axis}"


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[_ids(c) for c in BAD_INPUTS])
@pytest.mark.parametrize("mode", ["eager", "jit", "eval_shape"])
def test_bad_inputs_raise_value_error_naming_shape_and_format(case, mode):
    fmt, shape, dtype, axis, words = case
    f = lambda x: jax_fp4.quantize(x, fmt, axis=axis)  # noqa: E731
    x = jnp.zeros(shape, dtype)
    run = {"eager": f, "jit": jax.jit(f), "eval_shape": lambda x: jax.eval_shape(f, x)}[mode]
    with pytest.raises(ValueError) as info:
        run(x)
    msg = str(info.value)
    assert str(tuple(shape)) in msg and repr(fmt) in msg, msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_stochastic_rounding_needs_a_key(mode):
    fmt = jax_fp4.NVFP4(stochastic_rounding=True)
    f = lambda x: jax_fp4.quantize(x, fmt)  # noqa: E731
    with pytest.raises(ValueError, match="key") as info:
        (jax.jit(f) if mode == "jit" else f)(jnp.zeros((4, 32)))
    assert "(4, 32)" in str(info.value) and repr(fmt) in str(info.value)
    # with a key it works, and a key is ignored by the deterministic formats
    assert jax.eval_shape(lambda x, k: jax_fp4.quantize(x, fmt, key=k), jnp.zeros((4, 32)),
                          jax.random.key(0)).data.shape == (4, 32)
    assert jax.eval_shape(lambda x, k: jax_fp4.quantize(x, NV, key=k), jnp.zeros((4, 32)),
                          jax.random.key(0)).data.shape == (4, 32)


@pytest.mark.parametrize("make,match", [
    (lambda: jax_fp4.NVFP4(foo=True), "unknown option"),
    (lambda: jax_fp4.MXFP8(scaling_2d=True), "unknown option"),
    (lambda: jax_fp4.NVFP4(local_1x64=True, rht=True), "local_1x64"),
    (lambda: jax_fp4.NVFP4(local_1x64=True, scaling_2d=True), "local_1x64"),
    (lambda: jax_fp4.NVFP4(local_1x64=True, stochastic_rounding=True), "local_1x64"),
    (lambda: jax_fp4.NVFP4(scaling_2d=True, rht=True), "2D"),
    (lambda: jax_fp4.NVFP4(rht=1), "bool"),
    (lambda: jax_fp4.NVFP4(rht="yes"), "bool"),
    (lambda: jax_fp4.MXFP8(element="e3m4"), "e4m3"),
    (lambda: jax_fp4.MXFP8(element=jnp.int8), "e4m3"),
    (lambda: jax_fp4.MXFP8(element=None), "e4m3"),
])
def test_bad_format_options(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_scale_layout_and_format_argument():
    x = jnp.zeros((4, 32))
    with pytest.raises(ValueError, match="scale_layout") as info:
        jax_fp4.quantize(x, NV, scale_layout="padded")
    assert "padded" in str(info.value)
    with pytest.raises(ValueError, match="scale_layout"):
        jax.jit(lambda x: jax_fp4.quantize(x, MX, scale_layout="Swizzled"))(x)
    with pytest.raises(ValueError, match="fmt"):
        jax_fp4.quantize(x, "nvfp4")


def test_dequantize_rejects_non_quantized_arrays_and_bad_dtypes():
    q = quantize(jnp.ones((4, 32)), NV)
    for bad in (jnp.ones((4, 32)), (q.data, q.scale), None):
        with pytest.raises(ValueError, match="QuantizedArray"):
            jax_fp4.dequantize(bad)
    for dtype in (jnp.int32, jnp.float8_e4m3fn, jnp.uint8):
        with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
            jax_fp4.dequantize(q, dtype)
        with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
            jax.jit(lambda q, dtype=dtype: jax_fp4.dequantize(q, dtype))(q)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        assert jax.eval_shape(lambda q, dtype=dtype: jax_fp4.dequantize(q, dtype), q).dtype == dtype


def test_formats_are_frozen_hashable_values():
    a, b = jax_fp4.NVFP4(rht=True), jax_fp4.NVFP4(rht=True)
    assert a == b and hash(a) == hash(b) and a is not b
    assert a != jax_fp4.NVFP4() and jax_fp4.NVFP4() != jax_fp4.MXFP8()
    assert jax_fp4.MXFP8(element=jnp.float8_e5m2) == jax_fp4.MXFP8(element="e5m2")
    assert hash(jax_fp4.MXFP8(element=jnp.float8_e5m2)) == hash(jax_fp4.MXFP8(element="e5m2"))
    assert len({a, b, jax_fp4.NVFP4(), jax_fp4.MXFP8(), jax_fp4.MXFP8(element="e4m3")}) == 3
    with pytest.raises(AttributeError):
        a.rht = False
    with pytest.raises(AttributeError):
        a.new_field = 1
    assert a.rht is True and a.replace(rht=False) == jax_fp4.NVFP4()
    q = jax.eval_shape(lambda x: jax_fp4.quantize(x, a), jnp.ones((4, 32)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.axis = 0


def test_formats_work_as_jit_static_args():
    traces = []

    def f(x, fmt):
        traces.append(fmt)
        return jax_fp4.dequantize(jax_fp4.quantize(x, fmt))

    g = jax.jit(f, static_argnums=1)
    x = jnp.linspace(-3, 3, 64, dtype=jnp.float32).reshape(2, 32)
    y1 = g(x, jax_fp4.MXFP8(element="e5m2"))
    y2 = g(x, jax_fp4.MXFP8(element=jnp.float8_e5m2))  # equal and equally hashed: cache hit, no retrace
    assert len(traces) == 1 and (y1 == y2).all()
    g(x, jax_fp4.MXFP8())  # a different format retraces
    assert len(traces) == 2
    # QuantizedArray carries fmt / axis / scale_layout as static pytree metadata
    q = jax.jit(lambda x: jax_fp4.quantize(x, jax_fp4.NVFP4(), axis=0, scale_layout="swizzled"))(x.T)
    leaves, treedef = jax.tree.flatten(q)
    assert len(leaves) == 3 and q.fmt == jax_fp4.NVFP4() and q.axis == -2 and q.scale_layout == "swizzled"
