"""The quantize pass's exact GEMM operands (`jf4_quantize` with exact=(row, col), `quantize_rowwise_columnwise(...,
exact=...)`, `jax_fp4.gemm.ExactOperand`).

An exact orientation writes bfloat16 value(q) * block scale instead of the codes. Its contract is "bit for bit the
dequantize of the codes it replaces" (`exact_operand` of the QuantizedArray: the NVFP4 block-scales-only dequantize,
the MXFP8 dequantize to bfloat16), so every test compares against that independent path: on the CPU against the
QuantizedArray route (the reference), on the GPU kernel against the CPU reference (and the poisoned-output test
proves every bfloat16 is written). The scales stay those of the plain quantize.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _quantize_util import assert_leaf_bits, assert_same_bits, dtype_id, pair_id, random_input

import jax_fp4
from jax_fp4 import MXFP8, NVFP4, reference
from jax_fp4._src import ffi
from jax_fp4._src.primitives.quantize import OUTPUT_NAMES, ffi_attributes, quantize_3d, reference_outputs
from jax_fp4.gemm import ExactOperand, exact_dot_general, exact_operand, scaled_dot_general

KEY = jax.random.key(77)

#: (row_fmt, col_fmt) pairs with an exact-capable format on each quantized side.
EXACT_PAIRS = [
    (NVFP4(), MXFP8()),  # the NVFP4-forward / MXFP8-backward recipe's x
    (MXFP8(), MXFP8()),  # the MXFP8 recipes' x and dy
    (MXFP8(element="e5m2"), MXFP8(element="e5m2")),
    (NVFP4(stochastic_rounding=True), NVFP4(rht=True, stochastic_rounding=True)),  # the NVFP4 recipe's dy
    (NVFP4(scaling_2d=True), NVFP4(scaling_2d=True)),  # weights
    (None, MXFP8()),
    (NVFP4(), None),
]
EXACT_FLAGS = [(True, True), (True, False), (False, True)]


def _cases():
    out = []
    for i, pair in enumerate(EXACT_PAIRS):
        for ex in EXACT_FLAGS:
            if (ex[0] and pair[0] is None) or (ex[1] and pair[1] is None):
                continue
            dt = (jnp.bfloat16, jnp.float32, jnp.float16)[i % 3]
            out.append(pytest.param(pair, ex, dt, id=f"{pair_id(pair)}-exact{int(ex[0])}{int(ex[1])}-{dtype_id(dt)}"))
    return out


def _both(x, pair, exact, layout="compact"):
    """(exact route, QuantizedArray route) of one quantize_rowwise_columnwise call, same key."""
    row_fmt, col_fmt = pair
    fused = jax_fp4.quantize_rowwise_columnwise(x, row_fmt, col_fmt, key=KEY, exact=exact, scale_layout=layout)
    plain = jax_fp4.quantize_rowwise_columnwise(x, row_fmt, col_fmt, key=KEY, scale_layout=layout)
    return fused, plain


def _check_against_plain(fused, plain, exact, what):
    for side, on, f, p in (("row", exact[0], fused[0], plain[0]), ("col", exact[1], fused[1], plain[1])):
        if p is None:
            assert f is None
        elif on:
            assert isinstance(f, ExactOperand), type(f)
            want = exact_operand(p)
            assert f.values.dtype == jnp.bfloat16 and f.values.shape == p.shape, (f.values.dtype, f.values.shape)
            assert_leaf_bits(f.values, want[0], f"{what} {side} exact values")
            if want[1] is None:
                assert f.tensor_scale is None
            else:
                assert_leaf_bits(f.tensor_scale, want[1], f"{what} {side} tensor scale")
        else:
            assert_same_bits(f, p, f"{what} {side} (not exact)")


# ---- CPU: the reference's exact operands == exact_operand of the QuantizedArrays -----------------------------------
@pytest.mark.parametrize("pair,exact,dtype", _cases())
def test_exact_equals_dequantized_quantize(rng, pair, exact, dtype):
    x = random_input(rng, (128, 96), dtype)
    fused, plain = jax.jit(functools.partial(_both, pair=pair, exact=exact))(x)
    _check_against_plain(fused, plain, exact, f"{pair_id(pair)}")


def test_exact_scales_equal_plain_quantize(rng):
    """The exact call's scale results are the plain call's (only the data result changes)."""
    x3 = random_input(rng, (1, 128, 64), jnp.bfloat16)
    amax = jnp.full((1,), reference.amax(x3), jnp.float32)
    k = jnp.zeros((2,), jnp.uint32)
    params = dict(row_fmt=NVFP4(), col_fmt=MXFP8(), scale_layout="swizzled")
    fused = quantize_3d(x3, amax, amax, k, k, exact=(True, True), **params)
    plain = quantize_3d(x3, amax, amax, k, k, **params)
    for name in OUTPUT_NAMES:
        if name.endswith("_data"):
            assert fused[name].dtype == jnp.bfloat16 and fused[name].shape == plain[name].shape
        else:
            assert_leaf_bits(fused[name], plain[name], name)


@pytest.mark.parametrize("row_fmt,col_fmt,exact,match", [
    (NVFP4(local_1x64=True), None, (True, False), "1x64"),
    (None, NVFP4(local_1x64=True), (False, True), "1x64"),
    (MXFP8(), None, (False, True), "no exact columnwise"),
])
def test_exact_rejected(row_fmt, col_fmt, exact, match):
    x = jnp.zeros((64, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        jax_fp4.quantize_rowwise_columnwise(x, row_fmt, col_fmt, exact=exact)


def test_exact_under_vmap(rng):
    """The batching rule folds the batch into P with exact outputs too."""
    x = random_input(rng, (3, 64, 64), jnp.bfloat16)

    def f(x):
        return jax_fp4.quantize_rowwise_columnwise(x, MXFP8(), MXFP8(), exact=(True, True))[:2]

    got = jax.vmap(f)(x)
    for b in range(3):
        assert_same_bits(jax.tree.map(lambda a, b=b: a[b], got), f(x[b]), f"vmap example {b}")


@pytest.mark.parametrize("fmt", [NVFP4(), MXFP8()], ids=repr)
def test_exact_dot_general_equals_scaled_dot_general(rng, fmt):
    """The dense route (an ExactOperand from the quantize pass times a QuantizedArray) gives the bits of the
    QuantizedArray route (`scaled_dot_general`, emulated), tensor scales included.

    Pinned to the CPU backend: the claim is about the two routes' operands and scaling, and equal bits also need
    both GEMMs to sum in the same order, which XLA's GPU autotuning does not promise for two different dots (it
    failed once in the last bit on an H100 while other processes shared the GPU). The kernels' exact operands are
    checked against the reference bit for bit by test_kernel_exact_matches_reference."""
    cpu = jax.devices("cpu")[0]
    x = jax.device_put(random_input(rng, (64, 128), jnp.bfloat16), cpu)
    w = jax.device_put(random_input(rng, (128, 32), jnp.bfloat16), cpu)
    dn = (((1,), (0,)), ((), ()))

    def both(x, w):
        xe = jax_fp4.quantize_rowwise_columnwise(x, fmt, None, exact=(True, False))[0]
        wq = jax_fp4.quantize(w, fmt, axis=0)
        return exact_dot_general(xe, wq, dn), scaled_dot_general(jax_fp4.quantize(x, fmt), wq, dn,
                                                                 implementation="emulated")

    fused, plain = jax.jit(both)(x, w)
    assert_leaf_bits(fused, plain, f"{fmt!r} exact route")


def test_exact_dot_general_rejects_other_operands():
    q = jax_fp4.quantize(jnp.ones((32, 32), jnp.bfloat16), MXFP8())
    with pytest.raises(ValueError, match="rhs must be a QuantizedArray or an ExactOperand, got"):
        exact_dot_general(q, jnp.ones((32, 32), jnp.bfloat16), (((1,), (0,)), ((), ())))


# ---- GPU: the kernel's exact operands == the reference's ------------------------------------------------------------
def _gpu_tests():
    from test_quantize_kernels import gpu_vs_cpu, run_on  # noqa: PLC0415 - GPU helpers of the kernel tests

    return gpu_vs_cpu, run_on


@pytest.mark.gpu
@pytest.mark.parametrize("pair,exact,dtype", _cases())
@pytest.mark.parametrize("shape", [(256, 192), (2, 160, 64)], ids=str)
def test_kernel_exact_matches_reference(rng, pair, exact, dtype, shape):
    gpu_vs_cpu, _ = _gpu_tests()
    row_fmt, col_fmt = pair
    x = random_input(rng, shape, dtype)

    def f(x, key):
        return jax_fp4.quantize_rowwise_columnwise(x, row_fmt, col_fmt, key=key, exact=exact, dbias=col_fmt is not None)

    gpu_vs_cpu(f, x, KEY, skip=("[2]",), what=f"{pair_id(pair)} exact{exact}")


@pytest.mark.gpu
def test_kernel_exact_columnwise_only_tail(rng):
    """MXFP8 columnwise alone with K % 16 != 0 (the column threads' strided bfloat16 stores)."""
    gpu_vs_cpu, _ = _gpu_tests()
    x = random_input(rng, (96, 100), jnp.bfloat16)
    gpu_vs_cpu(lambda x: jax_fp4.quantize_rowwise_columnwise(x, None, MXFP8(), exact=(False, True)), x)


def _poison(s):
    dt = jnp.dtype(s.dtype)
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[dt.itemsize]
    if dt.name.startswith("float4"):
        return jax.lax.bitcast_convert_type(jnp.full(s.shape, 15, jnp.uint4), dt)
    return jax.lax.bitcast_convert_type(jnp.full(s.shape, jnp.iinfo(width).max, width), dt)


POISON_CASES = [  # (row_fmt, col_fmt, layout, x3 shape, exact)
    (NVFP4(), MXFP8(), "compact", (1, 256, 192), (True, False)),
    (MXFP8(), MXFP8(), "swizzled", (1, 320, 64), (True, True)),
    (NVFP4(), NVFP4(rht=True), "compact", (3, 64, 96), (True, True)),
    (None, MXFP8(element="e5m2"), "compact", (2, 96, 48), (False, True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("row_fmt,col_fmt,layout,shape,exact", POISON_CASES,
                         ids=[f"{c[0]!r}-{c[1]!r}-{c[2]}-{c[3]}-{c[4]}" for c in POISON_CASES])
def test_kernel_exact_poisoned_outputs(rng, row_fmt, col_fmt, layout, shape, exact):
    """The FFI target with every output aliased to a poisoned buffer writes every element of the exact results."""
    _, run_on = _gpu_tests()
    x3 = random_input(rng, shape, jnp.bfloat16)
    P = shape[0]
    amax = run_on(jax.devices("cpu")[0], lambda x: reference.amax(x, axis=(1, 2)), x3)
    amax_r = amax if isinstance(row_fmt, NVFP4) else np.zeros(P, np.float32)
    amax_c = amax if isinstance(col_fmt, NVFP4) else np.zeros(P, np.float32)
    zero_key = np.zeros(2, np.uint32)
    args = (x3, amax_r, amax_c, zero_key, zero_key)
    params = dict(row_fmt=row_fmt, col_fmt=col_fmt, scale_layout=layout, dbias=col_fmt is not None, exact=exact)
    shapes = jax.eval_shape(functools.partial(quantize_3d, **params), *args)
    results = [jax.ShapeDtypeStruct(shapes[n].shape, shapes[n].dtype) for n in OUTPUT_NAMES]
    attrs = ffi_attributes(row_fmt, col_fmt, layout, params["dbias"], exact)
    call = jax.ffi.ffi_call("jf4_quantize", results, input_output_aliases={5 + i: i for i in range(7)})

    def poisoned(*args):
        return call(*args, *[_poison(r) for r in results], **attrs)

    assert ffi.HAS_CUDA_KERNELS, f"GPU test without the CUDA extension: {ffi.import_error()}"
    got = run_on(jax.devices("gpu")[0], poisoned, *args)
    want = run_on(jax.devices("cpu")[0], functools.partial(reference_outputs, **params), *args)
    for name, g, w in zip(OUTPUT_NAMES, got, want, strict=True):
        if name != "dbias":
            assert_leaf_bits(g, w, f"poisoned {name}")
