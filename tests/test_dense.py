"""Recipes and the quantized `dense` / `dot_general` layer (custom VJP) on the CPU.

* recipes: construction, frozen/hashable, validation, the NVFP4 defaults and switches;
* BF16 == plain `lax.dot_general` (+ bias) bit for bit, forward and gradients;
* every quantized recipe: y, dx, dw and dbias against float64 products of the same quantized operands (reproduced with
  the documented key splitting and quantize calls, `_gemm_util.dense_operands`) within bounds derived from fp32
  accumulation over K / N / M and the casts (`_gemm_util`, nothing tuned); the operands are in the recipe's formats
  and round-trip through them (quantize(dequantize(q)) == q where that is defined);
* transformations: jit == eager, grad / value_and_grad, rank-3 x, dot_general with several output axes,
  jax.checkpoint with the residual-names policy and lax.scan over layers give the *same bits* (the same quantized
  operands feed dot_generals of the same shapes); vmap (a batched dot) and sharding (a partitioned dot) may reorder
  the fp32 sums and are checked against the bounds instead;
* residual bytes of the NVFP4-forward / MXFP8-backward recipe vs bfloat16; the trace-time errors.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _gemm_util import (
    DGRAD,
    FPROP,
    OPERAND_FIELDS,
    SLACK,
    WGRAD,
    check_dense,
    decode,
    dense_operands,
    dot64,
    f64,
    gamma,
    violates,
)
from _quantize_util import assert_same_bits, bits, jq

import jax_fp4
from jax_fp4 import MXFP8 as MXFP8Format
from jax_fp4 import NVFP4 as NVFP4Format
from jax_fp4 import dense, dot_general, recipes
from jax_fp4.dense import RESIDUAL_NAMES

M, K, N = 128, 128, 64
QUANTIZED = {
    "mxfp8": recipes.MXFP8(),
    "mxfp8-e5m2": recipes.MXFP8("e5m2"),
    "nvfp4": recipes.NVFP4(),
    "nvfp4-fwd-mxfp8-bwd": recipes.NVFP4Fwd_MXFP8Bwd(),
    "nvfp4-1x64": recipes.NVFP4_1x64(),
}
FWD_MX = QUANTIZED["nvfp4-fwd-mxfp8-bwd"]
MX = QUANTIZED["mxfp8"]


def _normal(rng, shape, dtype=jnp.bfloat16, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def _data(rng, m=M, k=K, n=N):
    """x[m, k], w[k, n], bias[n], dy[m, n] (bfloat16) and a PRNG key."""
    key = jax.random.key(int(rng.integers(2**31)))
    return _normal(rng, (m, k)), _normal(rng, (k, n), scale=k**-0.5), _normal(rng, (n,)), _normal(rng, (m, n)), key


@functools.partial(jax.jit, static_argnames=("recipe",))
def dense_vjp(x, w, b, dy, key, recipe):
    """(y, dx, dw, dbias) of dense(x, w, b) with the cotangent dy."""
    y, vjp = jax.vjp(lambda x, w, b: dense(x, w, b, recipe=recipe, key=key), x, w, b)
    return (y, *vjp(dy))


def _eager_vjp(x, w, b, dy, key, recipe):
    y, vjp = jax.vjp(lambda x, w, b: dense(x, w, b, recipe=recipe, key=key), x, w, b)
    return (y, *vjp(dy))


# ---- recipes ---------------------------------------------------------------------------------------------------------
def test_named_recipes():
    for name, make in recipes.RECIPES.items():
        r = make()
        assert r == recipes.by_name(name) and hash(r) == hash(make()) and r.name == name
        with pytest.raises(dataclasses.FrozenInstanceError):
            r.fprop_x = None
        assert r.quantized == (name != "bf16")
        assert len({r, make()}) == 1
    assert recipes.MXFP8("e5m2").dgrad_dy == MXFP8Format(element="e5m2") == recipes.MXFP8("e5m2").wgrad_dy
    assert recipes.MXFP8("e5m2").fprop_x == MXFP8Format() and recipes.MXFP8("e5m2") != recipes.MXFP8()
    with pytest.raises(ValueError, match="unknown recipe 'fp4'"):
        recipes.by_name("fp4")
    with pytest.raises(ValueError, match="gradients must be 'e4m3' or 'e5m2'"):
        recipes.MXFP8("e3m4")


def test_recipe_validation():
    with pytest.raises(ValueError, match="both fprop operands are quantized or neither"):
        recipes.Recipe("half", fprop_x=NVFP4Format())
    with pytest.raises(ValueError, match="both wgrad operands are quantized or neither"):
        recipes.Recipe("half", wgrad_dy=MXFP8Format())
    with pytest.raises(ValueError, match="RHT must be on both wgrad operands"):
        recipes.Recipe("rht1", wgrad_x=NVFP4Format(rht=True), wgrad_dy=NVFP4Format())
    with pytest.raises(ValueError, match="RHT must be on both dgrad operands"):
        recipes.Recipe("rht1", dgrad_dy=NVFP4Format(), dgrad_w=NVFP4Format(rht=True))


def test_nvfp4_defaults_and_switches():
    r = recipes.NVFP4()
    assert r.fprop_x == NVFP4Format() and r.fprop_w == r.dgrad_w == NVFP4Format(scaling_2d=True)
    assert r.dgrad_dy == NVFP4Format(stochastic_rounding=True)
    assert r.wgrad_x == NVFP4Format(rht=True) and r.wgrad_dy == NVFP4Format(rht=True, stochastic_rounding=True)
    assert r.needs_key and not recipes.NVFP4Fwd_MXFP8Bwd().needs_key and not recipes.MXFP8().needs_key
    off = recipes.NVFP4(rht=False, weight_2d=False, stochastic_rounding=False)
    assert all(f == NVFP4Format() for f in off.formats()) and not off.needs_key
    assert recipes.NVFP4(rht=False).wgrad_x == NVFP4Format()
    assert recipes.NVFP4(weight_2d=False).fprop_w == NVFP4Format()
    assert recipes.NVFP4(stochastic_rounding=False).dgrad_dy == NVFP4Format()
    f = recipes.NVFP4Fwd_MXFP8Bwd("e5m2")
    assert f.fprop_x == f.fprop_w == NVFP4Format() and f.dgrad_dy == f.wgrad_dy == MXFP8Format(element="e5m2")
    g = recipes.NVFP4_1x64()
    assert g.fprop_x == g.fprop_w == NVFP4Format(local_1x64=True) and g.dgrad_w == MXFP8Format()
    assert recipes.BF16().formats() == (None,) * 6 and not recipes.BF16().quantized


# ---- BF16 ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(M, K), (2, 64, K)])
def test_bf16_recipe_is_plain_dot_general(rng, shape):
    x, w, b, _, _ = _data(rng)
    x = x.reshape(shape)
    dy = _normal(rng, (*shape[:-1], N))
    dn = (((x.ndim - 1,), (0,)), ((), ()))

    def plain(x, w, b):
        return jax.lax.dot_general(x, w, dn) + b

    got = jax.jit(lambda x, w, b, dy: _eager_vjp(x, w, b, dy, None, recipes.BF16()))(x, w, b, dy)
    y, vjp = jax.vjp(plain, x, w, b)
    want = jax.jit(lambda x, w, b, dy: (lambda yv: (yv[0], *yv[1](dy)))(jax.vjp(plain, x, w, b)))(x, w, b, dy)
    assert got[0].dtype == jnp.bfloat16 and got[0].shape == (*shape[:-1], N)
    assert_same_bits(got, want, "bf16 recipe")
    assert_same_bits(dense(x, w, b, recipe=recipes.BF16()), y, "bf16 eager")


def test_bf16_recipe_equals_flax_linear(rng):
    nnx = pytest.importorskip("flax.nnx")
    x, w, b, _, _ = _data(rng)
    lin = nnx.Linear(K, N, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    lin.kernel, lin.bias = nnx.Param(w), nnx.Param(b)
    assert_same_bits(dense(x, w, b, recipe=recipes.BF16()), lin(x), "flax.nnx.Linear")


# ---- quantized recipes against float64 products of their operands ----------------------------------------------------
@pytest.mark.parametrize("name", list(QUANTIZED))
def test_recipe_against_fp64_products_of_its_operands(rng, name):
    """y, dx, dw, dbias of dense(x[128, 128], w[128, 64], bias) with cotangent dy, against float64 products of the
    operands reproduced with the documented key splitting and quantize calls (`_gemm_util.dense_operands`), in the
    formats and block axes the recipe assigns, within `check_dense`'s bounds (fp32 accumulation over K, N and M; the
    NVFP4 tensor scales; the fp32 bias addition; the bfloat16 casts). A wrong key (stochastic rounding), format,
    orientation or operand changes the result by quantization noise, far beyond the bounds."""
    recipe = QUANTIZED[name]
    x, w, b, dy, key = _data(rng)
    outs = dense_vjp(x, w, b, dy, key, recipe)
    assert [o.dtype for o in outs] == [jnp.bfloat16] * 4 and outs[0].shape == (M, N)
    ops = dense_operands(x, w, dy, key, recipe)
    for op, (field, axis) in OPERAND_FIELDS.items():
        assert ops[op].fmt == getattr(recipe, field) and ops[op].axis == axis, (op, ops[op])
    checked = check_dense(outs, ops, b, dy, name)
    # The bounds are far below the quantization error: the products of the unquantized inputs are rejected.
    for gemm, (a, c, dn) in {"y": (x, w, FPROP), "dx": (dy, w, DGRAD), "dw": (x, dy, WGRAD)}.items():
        plain = dot64(f64(a), f64(c), dn)[0] + (f64(b) if gemm == "y" else 0)
        assert violates(plain, *checked[gemm]), f"{name}: the {gemm} GEMM does not look quantized"


def _round_trip_ok(q, q2, what):
    """quantize(dequantize(q, bfloat16)) == q. Why (tests/reference/test_properties.py makes the argument for
    float32): a bfloat16 dequantized value is off by at most 2**-8 relative (plus a few fp32 roundings), far inside
    the margins that decide the codes: a normal E4M3 block scale is re-derived from a value within ~2**-7 of itself
    (the next rounding boundary is 2**-5 away), and every value(q) * 1/scale lands within ~2**-7 of its E2M1 grid
    point (the nearest midpoint is >= 1/12 relative away). So data and scale codes are equal; the NVFP4 tensor amax
    (1x64: the window amaxes) is re-measured on the rounded values: within 2**-8 + 2**-20 relative. MXFP8 values are
    exact in bfloat16, and the codes are equal except in blocks whose largest |value| is max_norm / 2, where the
    exponent drops by one and every code doubles (test_mxfp8_requantize_is_a_fixed_point_except_half_max_blocks):
    there the decoded values must be equal."""
    assert q2.fmt == q.fmt and q2.axis == q.axis
    if isinstance(q.fmt, NVFP4Format):
        np.testing.assert_array_equal(bits(q2.data), bits(q.data), err_msg=what)
        np.testing.assert_array_equal(bits(q2.scale), bits(q.scale), err_msg=what)
        a, a2 = (f64(q.window_amax), f64(q2.window_amax)) if q.fmt.local_1x64 else (f64(q.amax), f64(q2.amax))
        assert np.all(np.abs(a2 - a) <= (2.0**-8 + 2.0**-20) * a), (what, a, a2)
        return
    blocks = lambda a: np.moveaxis(np.asarray(a), q.axis, -1).reshape(-1, 32)  # noqa: E731
    special = np.abs(blocks(f64(q.data))).max(-1) == q.fmt.max_value / 2
    scales = lambda s: np.moveaxis(bits(s), q.axis, -1).reshape(-1)  # noqa: E731
    np.testing.assert_array_equal(scales(q2.scale)[~special], scales(q.scale)[~special], err_msg=what)
    np.testing.assert_array_equal(bits(blocks(q2.data))[~special], bits(blocks(q.data))[~special], err_msg=what)
    np.testing.assert_array_equal(decode(q2), decode(q), err_msg=what)


_dequantize_bf16 = jax.jit(functools.partial(jax_fp4.dequantize, dtype=jnp.bfloat16))


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_operands_round_trip_through_their_formats(rng, name):
    """Each GEMM operand q of the recipe (format and block axis as the recipe assigns) satisfies
    quantize(dequantize(q), recipe format, axis) == q (see _round_trip_ok). Skipped operands: RHT (re-quantizing
    applies H to Hᵀ-transformed values and rounds them to bf16 again) and stochastic rounding (a value a few ulps
    below a grid point rounds down with probability ~1 - 1/256): neither is idempotent by design
    (tests/reference/test_properties.py)."""
    recipe = QUANTIZED[name]
    x, w, _, dy, key = _data(rng)
    ops = dense_operands(x, w, dy, key, recipe)
    checked = 0
    for op, (field, axis) in OPERAND_FIELDS.items():
        q, fmt = ops[op], getattr(recipe, field)
        if isinstance(fmt, NVFP4Format) and (fmt.rht or fmt.stochastic_rounding):
            continue
        q2 = jq(_dequantize_bf16(q), fmt, -1 if axis == -1 else 0)
        _round_trip_ok(q, q2, f"{name} {op}")
        checked += 1
    assert checked == (3 if name == "nvfp4" else 6)


# ---- transformations -------------------------------------------------------------------------------------------------
def test_jit_equals_eager(rng):
    x, w, b, dy, key = _data(rng)
    assert_same_bits(_eager_vjp(x, w, b, dy, key, MX), dense_vjp(x, w, b, dy, key, MX), "eager vs jit")


def test_rank3_x_equals_flattened(rng):
    """x[2, 64, K] is dense of x.reshape(128, K) (tokens M = 2 * 64), checked against fp64 products itself."""
    x, w, b, dy, key = _data(rng)
    got = dense_vjp(x.reshape(2, 64, K), w, b, dy.reshape(2, 64, N), key, MX)
    want = dense_vjp(x, w, b, dy, key, MX)
    assert got[0].shape == (2, 64, N) and got[1].shape == (2, 64, K)
    assert_same_bits((got[0].reshape(M, N), got[1].reshape(M, K), *got[2:]), want, "rank 3")
    check_dense(want, dense_operands(x, w, dy, key, MX), b, dy, "rank 2")


def test_dot_general_with_several_output_axes(rng):
    x, _, _, _, key = _data(rng)
    w, dy = _normal(rng, (K, K), scale=K**-0.5), _normal(rng, (M, K))  # N = 128 = 4 x 32 (shared with the scan test)
    w3, dy3 = w.reshape(K, 4, 32), dy.reshape(M, 4, 32)

    @jax.jit
    def f(x, w3, dy3):
        y, vjp = jax.vjp(lambda x, w3: dot_general(x, w3, (((1,), (0,)), ((), ())), recipe=MX), x, w3)
        return (y, *vjp(dy3))

    y, dx, dw3 = f(x, w3, dy3)
    assert y.shape == (M, 4, 32) and dw3.shape == w3.shape
    want = dense_vjp(x, w, None, dy, key, MX)
    assert_same_bits((y.reshape(M, K), dx, dw3.reshape(K, K)), want[:3], "dot_general [K, N1, N2]")


def test_grad_and_value_and_grad(rng):
    """loss = sum(y * c): the gradients are dense's VJP with dy = c (c bfloat16-exact), bit for bit; the loss is an
    fp32 sum of exact products y * c (8 x 8 significant bits), within gamma_(MN-1) sum |y c| of the fp64 sum."""
    x, w, b, _, key = _data(rng)
    c = _normal(rng, (M, N))

    def loss(x, w, b):
        return jnp.sum(dense(x, w, b, recipe=MX, key=key).astype(jnp.float32) * c.astype(jnp.float32))

    (value, grads), grads2 = jax.jit(lambda *a: (jax.value_and_grad(loss, (0, 1, 2))(*a),
                                                 jax.grad(loss, (0, 1, 2))(*a)))(x, w, b)
    want = dense_vjp(x, w, b, c, key, MX)
    assert_same_bits(grads, want[1:], "value_and_grad")
    assert_same_bits(grads2, want[1:], "grad")
    yc = f64(want[0]) * f64(c)
    assert abs(float(value) - yc.sum()) <= (gamma(M * N - 1) + SLACK) * np.abs(yc).sum()


def test_vmap_is_per_example(rng):
    """vmap over a leading batch of x: per-example tensor amaxes (example 1 is 2**-16 times smaller: with a shared
    amax its NVFP4 block scales would be E4M3 subnormals, i.e. different, coarser operands), so
    vmap(dense)(xb)[i] and dense(xb[i]) are both within the bounds of the float64 products of example i's own operands
    (a batched dot may order the fp32 sums differently: not bit for bit). The bias is zero: a unit bias would swamp
    example 1's tiny GEMM in y's bfloat16 rounding."""
    x, w, b, dy, key = _data(rng)
    b = jnp.zeros_like(b)
    xb = jnp.stack([x, (x.astype(jnp.float32) * 2.0**-16).astype(jnp.bfloat16)])
    dyb = jnp.stack([dy, _normal(rng, (M, N))])
    vm = jax.jit(jax.vmap(lambda x, dy: dense_vjp(x, w, b, dy, key, FWD_MX)))(xb, dyb)
    for i in range(2):
        ops = dense_operands(xb[i], w, dyb[i], key, FWD_MX)
        check_dense([o[i] for o in vm], ops, b, dyb[i], f"vmap example {i}")
        check_dense(dense_vjp(xb[i], w, b, dyb[i], key, FWD_MX), ops, b, dyb[i], f"unbatched example {i}")


def test_checkpoint_with_residual_names_policy(rng, capsys):
    x, w, b, dy, key = _data(rng)
    policy = jax.checkpoint_policies.save_only_these_names(*RESIDUAL_NAMES)

    def f(x, w, b):
        return dense(x, w, b, recipe=MX, key=key)

    @jax.jit
    def remat_vjp(x, w, b, dy):
        y, vjp = jax.vjp(jax.checkpoint(f, policy=policy), x, w, b)
        return (y, *vjp(dy))

    assert_same_bits(remat_vjp(x, w, b, dy), dense_vjp(x, w, b, dy, key, MX), "checkpoint")
    # The policy keeps exactly the named quantized residuals (fp8 data + e8m0 scales of x_wgrad and w_dgrad), no
    # argument (dense.py's zero-size dtype tags may show up as constants).
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(f, policy=policy), x, w, b)
    lines = capsys.readouterr().out.strip().splitlines()
    named = [ln for ln in lines if "named '" in ln]
    assert sorted({ln.split("named '")[1].split("'")[0] for ln in named}) == sorted(RESIDUAL_NAMES), lines
    assert len(named) == 4 and not [ln for ln in lines if "from the argument" in ln], lines


def test_scan_over_layers_equals_python_loop(rng):
    """lax.scan over 3 stacked layers (weights [3, K, K]) == the layers called one by one in a Python loop (forward,
    then the chain of per-layer VJPs), bit for bit."""
    x, _, _, _, key = _data(rng)
    ws = _normal(rng, (3, K, K), scale=K**-0.5)
    dy = _normal(rng, (M, K))

    @jax.jit
    def scan_vjp(x, ws, dy):
        y, vjp = jax.vjp(lambda x, ws: jax.lax.scan(lambda h, w: (dense(h, w, recipe=MX), None), x, ws)[0], x, ws)
        return (y, *vjp(dy))

    y, dx, dws = scan_vjp(x, ws, dy)
    hs = [x]
    for i in range(3):
        hs.append(dense_vjp(hs[-1], ws[i], None, dy, key, MX)[0])  # (the cotangent does not affect y)
    g, dw_loop = dy, [None] * 3
    for i in reversed(range(3)):
        _, g, dw_loop[i], _ = dense_vjp(hs[i], ws[i], None, g, key, MX)
    assert dws.shape == ws.shape
    assert_same_bits((y, dx, dws), (hs[-1], g, jnp.stack(dw_loop)), "scan vs loop")


# ---- residual memory -------------------------------------------------------------------------------------------------
def _nbytes(a) -> float:
    return a.size * (0.5 if jnp.dtype(a.dtype).name.startswith("float4") else jnp.dtype(a.dtype).itemsize)


def _residual_arrays(recipe):
    """jit(x, w -> the arrays held by dense's VJP closure)."""
    def f(x, w):
        return jax.tree.leaves(jax.vjp(lambda x, w: dense(x, w, recipe=recipe), x, w)[1])
    return f


def test_residual_bytes(rng, record_property):
    """NVFP4-forward / MXFP8-backward keeps the MXFP8 wgrad x and dgrad w (1 byte + 1/32 byte per element):
    <= 0.6x the bfloat16 recipe's x and w (2 bytes each). The compiled memory analysis is reported, not asserted."""
    x, w = _normal(rng, (256, 256)), _normal(rng, (256, 256))
    compiled = jax.jit(_residual_arrays(FWD_MX)).lower(x, w).compile()
    res = [a for a in compiled(x, w) if a.size]  # zero-size dtype tags (0 bytes) left out
    bf16 = jax.jit(_residual_arrays(recipes.BF16()))(x, w)
    assert sorted(a.dtype.name for a in res) == ["float8_e4m3fn"] * 2 + ["float8_e8m0fnu"] * 2, res
    q_bytes, bf16_bytes = sum(map(_nbytes, res)), sum(map(_nbytes, bf16))
    assert bf16_bytes == 2 * 256 * 256 * 2
    assert q_bytes == 2 * (256 * 256 + 256 * 256 // 32)
    assert q_bytes <= 0.6 * bf16_bytes
    mem = compiled.memory_analysis()
    out_bytes = getattr(mem, "output_size_in_bytes", None)
    record_property("residual_output_size_in_bytes", out_bytes)
    print(f"residual bytes: pytree {q_bytes} (bf16 recipe {bf16_bytes}); compiled output_size_in_bytes {out_bytes}")


def test_vjp_closure_can_leave_jit(rng):
    """dense's residuals are all arrays (quantized operands, zero-size dtype tags), so a pullback returned from
    jax.jit works and gives dense's gradients."""
    x, w, b, dy, key = _data(rng)
    vjp = jax.jit(lambda x, w, b: jax.vjp(lambda x, w, b: dense(x, w, b, recipe=MX), x, w, b)[1])(x, w, b)
    assert_same_bits(vjp(dy), dense_vjp(x, w, b, dy, key, MX)[1:], "vjp closure returned from jit")


# ---- errors ----------------------------------------------------------------------------------------------------------
def test_errors():
    x, w = jnp.ones((64, 128), jnp.bfloat16), jnp.ones((128, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"do not line up"):
        dense(x, jnp.ones((129, 64), jnp.bfloat16), recipe=MX)
    with pytest.raises(ValueError, match=r"do not line up"):
        dense(x, jnp.ones((128,), jnp.bfloat16), recipe=MX)
    with pytest.raises(ValueError, match=r"bias shape \(63,\)"):
        dense(x, w, jnp.ones((63,), jnp.bfloat16), recipe=MX)
    with pytest.raises(ValueError, match="nvfp4 rounds a gradient operand stochastically.*needs key"):
        jax.grad(lambda x: dense(x, w, recipe=recipes.NVFP4()).astype(jnp.float32).sum())(x)
    with pytest.raises(ValueError, match="listed twice"):
        dot_general(x, w, (((1,), (0,)), ((1,), (0,))), recipe=MX)
    with pytest.raises(ValueError, match="out of range"):  # no modulo wrapping
        dot_general(x, w, (((2,), (0,)), ((), ())), recipe=MX)
    with pytest.raises(ValueError, match=r"x dimension 1 \(128\) != w dimension 1 \(64\)"):
        dot_general(x, w, (((1,), (1,)), ((), ())), recipe=MX)
    with pytest.raises(ValueError, match=r"wgrad x \[M=48, K=128\] \(MXFP8\(\) blocks along M\): M=48 is not a "
                       r"multiple of 32"):  # wgrad blocks run along M
        jax.grad(lambda x: dense(x, w, recipe=MX).astype(jnp.float32).sum())(jnp.ones((48, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"fprop x \[M=64, K=120\] \(NVFP4\(\) blocks along K\): K=120"):
        dense(jnp.ones((64, 120), jnp.bfloat16), jnp.ones((120, 64), jnp.bfloat16), recipe=FWD_MX)


# ---- sharding (8 forced CPU devices, in a subprocess: XLA_FLAGS must precede the backend) ----------------------------
SHARDING_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from _gemm_util import check_dense, dense_operands
    from jax_fp4 import dense, recipes

    assert len(jax.devices()) == 8, jax.devices()
    rng = np.random.default_rng({seed})
    M, K, N = 256, 128, 64
    # Every batch shard (32 rows) and both halves of the output features get their own magnitude: per-shard amaxes
    # instead of the global ones would change the NVFP4 operands far beyond the bounds.
    x = jnp.asarray(rng.standard_normal((M, K)) * np.repeat(2.0 ** np.arange(-4, 4), 32)[:, None], jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((K, N)) * np.repeat([1.0, 2.0**-6], N // 2)[None], jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(N), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16)
    key = jax.random.key(0)

    def step(x, w, b, dy, recipe):
        y, vjp = jax.vjp(lambda x, w, b: dense(x, w, b, recipe=recipe), x, w, b)
        return (y, *vjp(dy))

    mesh1 = Mesh(np.array(jax.devices()).reshape(8), ("data",))
    mesh2 = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    cases = {{
        "batch-sharded x": (NamedSharding(mesh1, P("data", None)), NamedSharding(mesh1, P()),
                            NamedSharding(mesh1, P("data", None))),
        "output-feature-sharded w": (NamedSharding(mesh2, P("data", None)), NamedSharding(mesh2, P(None, "model")),
                                     NamedSharding(mesh2, P("data", "model"))),
    }}
    for recipe in (recipes.NVFP4Fwd_MXFP8Bwd(), recipes.MXFP8()):
        ops = dense_operands(x, w, dy, key, recipe)
        for name, (sx, sw, sdy) in cases.items():
            outs = jax.jit(step, static_argnums=4)(jax.device_put(x, sx), jax.device_put(w, sw), b,
                                                    jax.device_put(dy, sdy), recipe)
            assert outs[0].sharding.spec[0] == "data", outs[0].sharding
            check_dense(outs, ops, b, dy, f"{{recipe.name}} {{name}}")
    print("SHARDING OK")
    """
)


def test_sharded_inputs(rng):
    """Batch-sharded x (8 devices) and output-feature-sharded w ((data, model) = (4, 2)): y, dx, dw, dbias within the
    bounds of the float64 products of the *unsharded* operands (partitioned dots may reorder the fp32 sums)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    script = SHARDING_SCRIPT.format(tests=tests, seed=int(rng.integers(2**31)))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-P", "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "SHARDING OK" in r.stdout, r.stderr[-4000:]
