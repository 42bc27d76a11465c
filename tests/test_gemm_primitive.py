"""The `jf4_gemm` primitive and the "kernel" route of `scaled_dot_general` / `dense`.

CPU (the primitive lowers to the emulation there):
* the primitive equals `exact_dot_general` of the same K-major operands bit for bit, per format pairing (NVFP4 1D,
  2D weight, RHT pair, 1x64, MXFP8 E4M3 / E5M2, NVFP4 x MXFP8), with bias, bfloat16 output and the output amax;
* its trace-time errors, vmap (folded into M, or one call per example), the JVP error;
* routing: `kernel_gemm_available` only on compute capability 9.x with the kernel registered; `jax_fp4.route.gemm_route`
  on a given device; "auto" takes the kernel there for 2-D NVFP4 1x64 products (availability monkeypatched), not for
  batch axes or 1x64 x non-1x64; "kernel"
  raises where it cannot run; the layout conversions (swizzled scales, MXFP8 blocked along a non-last axis, NVFP4 2D,
  leading axes folded into M) give the emulated route's product: bit for bit on inputs whose fp32 sums are exact
  in any order (`exact_input`), within the derived bound (`_gemm_util`) on random inputs;
* dense with implementation="kernel" (availability monkeypatched) gives the emulated bits on the CPU.
GPU (`gpu` marker; needs compute capability 9.x and the CUDA extension with jf4_gemm, else skipped): the kernel route
against float64 products of the decoded operands within `kernel_gemm_bound` (tensor-core fp32 accumulation over
K, not tuned), against the emulated route within the sum of both bounds, bit for bit on exactly summable inputs
(not 1x64: its window factors round), and dense fwd + bwd per recipe.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _gemm_util import assert_within, cast_bound, check_dense, dense_operands, operand_bound
from _quantize_util import bits, jq

import jax_fp4
from jax_fp4 import MXFP8, NVFP4, recipes
from jax_fp4 import gemm as gemm_module
from jax_fp4 import route as route_module
from jax_fp4._src.primitives import gemm as prim
from jax_fp4._src.primitives.gemm_operands import kernel_operand
from jax_fp4.dense import gemm_routes
from jax_fp4.reference.nvfp4 import decode_amax

M, K, N = 128, 128, 64
NV, NV2D, NVRHT, NV64 = NVFP4(), NVFP4(scaling_2d=True), NVFP4(rht=True), NVFP4(local_1x64=True)
MX4, MX5 = MXFP8(), MXFP8(element="e5m2")
PAIRS = {
    "nvfp4": (NV, NV),
    "nvfp4 x 2d": (NV, NV2D),
    "nvfp4-rht": (NVRHT, NVRHT),
    "nvfp4-1x64": (NV64, NV64),
    "mxfp8-e4m3": (MX4, MX4),
    "mxfp8-e5m2 x e4m3": (MX5, MX4),
    "nvfp4 x mxfp8": (NV, MX4),
}
GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def _normal(rng, shape):
    rows = 2.0 ** rng.uniform(-3, 3, (shape[0],) + (1,) * (len(shape) - 1))
    return jnp.asarray(rng.standard_normal(shape) * rows, jnp.bfloat16)


def exact_input(rng, shape, block_axis):
    """bfloat16 [R, C]: E2M1 grid values with a +-6 at every (i + j) % 16 == 0 (every 16-block along either axis
    holds one), times 2**r (r in {0, 1}) per index of the non-block axis, so the block scales vary. Every NVFP4 / 1x64
    / MXFP8 quantization of it along `block_axis` is exact (amax 6 * 2**r per block and tensor amax 12; section 1
    and 2 of docs/numerics.md), its block-scaled values are multiples of 112 (NVFP4) or 1/2 (MXFP8, 1x64) below
    2688, and a K <= 128 sum of products of two of them stays below 2**24 quanta: every fp32 summation order gives
    the same, exact result."""
    r, c = shape
    v = rng.choice(GRID, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    i, j = np.indices(shape)
    v = np.where((i + j) % 16 == 0, 6.0 * rng.choice([-1.0, 1.0], size=shape), v)
    other = 1 - block_axis % 2
    f = 2.0 ** rng.integers(0, 2, size=shape[other])
    v = v * (f[:, None] if other == 0 else f[None, :])
    return jnp.asarray(v, jnp.bfloat16)


def _operands(rng, pair, make=None):
    fa, fb = PAIRS[pair]
    make = make or (lambda shape, axis: _normal(rng, shape))
    return jq(make((M, K), -1), fa, -1), jq(make((N, K), -1), fb, -1)


def _kernel_args(q):
    (d, s, x), _ = kernel_operand(q)
    return d, s, x


@functools.partial(jax.jit, static_argnames=("out_dtype", "emit_amax"))
def prim_and_exact(a, b, bias=None, out_dtype=jnp.float32, emit_amax=False):
    out, amax = prim.gemm(*_kernel_args(a), *_kernel_args(b), bias, a_fmt=a.fmt, b_fmt=b.fmt, out_dtype=out_dtype,
                          emit_amax=emit_amax)
    want = gemm_module.exact_dot_general(a, b, prim.TN, jnp.float32)
    if bias is not None:
        want = want + bias
    return out, amax, want.astype(out_dtype)


# Tests of the CPU program (the primitive's CPU lowering, a device without the kernel, the kernel route pretended by
# `kernel_here` and lowered to the emulation): on a GPU backend they would test something else, so they skip there.
cpu_design = pytest.mark.skipif(jax.default_backend() != "cpu", reason="tests the CPU program (GPU: the -m gpu tests)")


@cpu_design
@pytest.mark.parametrize("pair", list(PAIRS))
def test_cpu_lowering_equals_exact_dot_general(rng, pair):
    a, b = _operands(rng, pair)
    out, amax, want = prim_and_exact(a, b)
    assert out.dtype == jnp.float32 and out.shape == (M, N) and amax.shape == ()
    np.testing.assert_array_equal(bits(out), bits(want))
    assert float(amax) == 0.0  # not emitted


def test_bias_bfloat16_output_and_amax(rng):
    a, b = _operands(rng, "nvfp4 x mxfp8")
    bias = jnp.asarray(rng.standard_normal(N) * 100, jnp.float32)
    out, amax, want = prim_and_exact(a, b, bias, out_dtype=jnp.bfloat16, emit_amax=True)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(bits(out), bits(want))
    assert float(amax) == float(np.max(np.abs(np.asarray(out, np.float32))))
    nan_a = jax_fp4.QuantizedArray(a.data, a.scale, jnp.float32(np.nan), None, fmt=a.fmt, axis=a.axis)
    out, amax, _ = prim_and_exact(nan_a, b, bias, out_dtype=jnp.bfloat16, emit_amax=True)
    assert np.all(np.isnan(np.asarray(out, np.float32))) and np.isnan(float(amax))


def test_tensor_amax_enters_through_decode_amax(rng):
    """The kernel operand carries decode_amax(amax) (the kernel's scale is fp32(aux) * fp32(1/2688)); the emulated
    lowering gives the same bits as with the raw amax (decode_amax is idempotent), also for a tiny amax."""
    a, b = _operands(rng, "nvfp4")
    tiny = jax_fp4.QuantizedArray(a.data, a.scale, jnp.float32(1e-37), None, fmt=a.fmt, axis=a.axis)
    _, _, aux = _kernel_args(tiny)
    assert float(aux) == float(decode_amax(jnp.float32(1e-37))) > 1e-37
    out, _, want = prim_and_exact(tiny, b)
    np.testing.assert_array_equal(bits(out), bits(want))


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def _nv(rows, k=K):
    return _spec((rows, k), jnp.float4_e2m1fn), _spec((rows, k // 16), jnp.float8_e4m3fn), _spec((), jnp.float32)


def _mx(rows, k=K):
    return _spec((rows, k), jnp.float8_e4m3fn), _spec((rows, k // 32), jnp.float8_e8m0fnu), _spec((0,), jnp.float32)


def _nv64(rows, k=K):
    return (_spec((rows, k), jnp.float4_e2m1fn), _spec((rows, k // 16), jnp.float8_e4m3fn),
            _spec((rows, k // 64), jnp.float32))


def _eval(a, b, bias=None, a_fmt=NV, b_fmt=MX4, out_dtype=jnp.float32):
    bias = _spec((0,), jnp.float32) if bias is None else bias
    return jax.eval_shape(lambda *ops: prim.gemm_p.bind(*ops, a_fmt=a_fmt, b_fmt=b_fmt, out_dtype=jnp.dtype(out_dtype),
                                                         emit_amax=False), *a, *b, bias)


def test_abstract_eval_and_errors():
    out, amax = _eval(_nv(M), _mx(N), _spec((N,), jnp.float32), out_dtype=jnp.bfloat16)
    assert (out.shape, out.dtype, amax.shape, amax.dtype) == ((M, N), jnp.bfloat16, (), jnp.float32)
    cases = [
        (dict(b=_mx(N, 2 * K)), r"contracting lengths differ: a_data float4_e2m1fn\[128, 128\] vs b_data"),
        (dict(b=(_spec((N, K), jnp.float8_e5m2),) + _mx(N)[1:]), r"b_data must be float8_e4m3fn\[rows, K\]"),
        (dict(a=(_nv(M)[0], _spec((M, K // 32), jnp.float8_e4m3fn), _nv(M)[2])), r"a_scale must be .*\[128, 8\]"),
        (dict(a=_nv(M)[:2] + (_spec((1,), jnp.float32),)), r"a_aux must be float32\[\] \(the tensor amax"),
        (dict(b=_mx(N)[:2] + (_spec((), jnp.float32),)), r"b_aux must be float32\[0\] \(empty"),
        (dict(a=_nv64(M), a_fmt=NV64), r"1x64 operands pair only with NVFP4 1x64"),
        (dict(a=_nv64(M, 96), b=_nv64(N, 96), a_fmt=NV64, b_fmt=NV64), r"K = 96 is not a multiple of 64"),
        (dict(bias=_spec((M,), jnp.float32)), r"bias must be float32\[64\]"),
        (dict(bias=_spec((N,), jnp.bfloat16)), r"bias must be float32\[64\]"),
        (dict(out_dtype=jnp.float16), "out_dtype must be float32 or bfloat16"),
        (dict(a=(_spec((2, M, K), jnp.float4_e2m1fn),) + _nv(M)[1:]), "must be rank 2"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            _eval(**{"a": _nv(M), "b": _mx(N), **kw})
    assert _eval(_nv64(M), _nv64(N), a_fmt=NV64, b_fmt=NV64)[0].shape == (M, N)


def test_not_differentiable(rng):
    a, b = _operands(rng, "mxfp8-e4m3")
    args = (*_kernel_args(a), *_kernel_args(b))
    f = jnp.zeros((0,), jnp.float32)

    def loss(bias):
        return jnp.sum(prim.gemm(*args, bias, a_fmt=a.fmt, b_fmt=b.fmt)[0])

    with pytest.raises(TypeError, match="jf4_gemm .* has no derivative"):
        jax.grad(loss)(f)


@pytest.mark.parametrize("pair,batched", [("mxfp8-e4m3", "a"), ("nvfp4-1x64", "a"), ("nvfp4", "a"),
                                          ("nvfp4-1x64", "both")])
def test_vmap(rng, pair, batched):
    """vmap == a loop over the examples, bit for bit: a batched A with a shared B is folded into M (MXFP8, 1x64
    without amax output) or mapped (an NVFP4 tensor amax per example); both batched: mapped."""
    fa, fb = PAIRS[pair]
    m = 64
    xs = [jq(_normal(rng, (m, K)), fa) for _ in range(2)]
    ws = [jq(_normal(rng, (N, K)), fb) for _ in range(2 if batched == "both" else 1)]
    stack = lambda qs: jax.tree.map(lambda *leaves: jnp.stack(leaves), *qs)  # noqa: E731

    def one(a, b):
        return prim.gemm(*_kernel_args(a), *_kernel_args(b), a_fmt=fa, b_fmt=fb, out_dtype=jnp.bfloat16)[0]

    got = jax.jit(jax.vmap(one, in_axes=(0, 0 if batched == "both" else None)))(
        stack(xs), stack(ws) if batched == "both" else ws[0])
    for i in range(2):
        want = jax.jit(one)(xs[i], ws[i if batched == "both" else 0])
        np.testing.assert_array_equal(bits(got[i]), bits(want), err_msg=f"example {i}")


# ---- routing -------------------------------------------------------------------------------------------------------
class _Device:
    def __init__(self, platform, cc):
        self.platform, self.compute_capability = platform, cc


@pytest.mark.parametrize("platform,cc,registered,want", [("gpu", "9.0", True, True), ("gpu", "9.0", False, False),
                                                         ("gpu", "10.0", True, False), ("gpu", "8.9", True, False),
                                                         ("cpu", None, True, False)])
def test_kernel_gemm_available(monkeypatch, platform, cc, registered, want):
    monkeypatch.setattr(prim, "cuda_kernel_registered", lambda: registered)
    monkeypatch.setattr(route_module.jax, "devices", lambda: [_Device(platform, cc)])
    assert route_module.kernel_gemm_available() is want


@pytest.fixture
def kernel_here(monkeypatch):
    """Pretend the default device runs jf4_gemm (on the CPU the primitive lowers to the emulation)."""
    monkeypatch.setattr(route_module, "kernel_gemm_available", lambda: True)


def test_auto_leaves_the_kernel_while_it_is_slower(rng, monkeypatch):
    """"auto" takes the kernel only for NVFP4 1x64 pairs (measured faster than their float32 emulation) and
    emulates MXFP8 / NVFP4 1D where it runs; implementation="kernel" still takes those."""
    monkeypatch.setattr(route_module, "kernel_gemm_available", lambda: True)
    assert route_module.gemm_route(NV, NV) == "emulated"
    assert route_module.gemm_route(NV64, NV64) == "kernel"  # the one pairing it beats the emulated route on
    assert gemm_routes(recipes.MXFP8())["fprop"] == "emulated"
    r = recipes.NVFP4_1x64()  # 1x64 in fprop only; its backward GEMMs are NVFP4 1D pairs
    want = {g: ("kernel" if fa.local_1x64 and fb.local_1x64 else "emulated")
            for g, (fa, fb) in (("fprop", (r.fprop_x, r.fprop_w)), ("dgrad", (r.dgrad_dy, r.dgrad_w)),
                                ("wgrad", (r.wgrad_x, r.wgrad_dy)))}
    assert want["fprop"] == "kernel" and gemm_routes(r) == want
    assert gemm_routes(recipes.MXFP8(), "kernel") == {"fprop": "kernel", "dgrad": "kernel", "wgrad": "kernel"}
    a, b = _operands(rng, "nvfp4")
    assert "jf4_gemm" not in _primitives(lambda a, b: jax_fp4.scaled_dot_general(a, b, prim.TN), a, b)
    assert "jf4_gemm" in _primitives(lambda a, b: jax_fp4.scaled_dot_general(a, b, prim.TN, implementation="kernel"),
                                     a, b)


def _primitives(fn, *args):
    """Names of the primitives in fn's jaxpr, nested jaxprs (jit, custom_vjp, map) included."""
    names = set()

    def walk(jaxpr):
        for e in jaxpr.eqns:
            names.add(e.primitive.name)
            for v in e.params.values():
                for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        walk(sub.jaxpr)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names


def test_gemm_route_on_a_kernel_device():
    """gemm_route is a function of the formats, the implementation and the device alone."""
    dev = route_module.GemmDevice(kernel=True)
    route = route_module.gemm_route
    assert route(NV, NV2D, "kernel", dev) == "kernel" == route(MX5, MX4, "kernel", dev)
    assert route(NV64, NV64, "kernel", dev) == "kernel" == route(NVRHT, NVRHT, "kernel", dev)
    assert route(NV64, MX4, "kernel", dev) == "emulated" and route(None, NV, "kernel", dev) == "bf16"
    assert route(NV, NV, "auto", dev) == "emulated" and route(NV64, NV64, "auto", dev) == "kernel"
    assert route(NV64, NV64, "auto", dev, kernel_fits=False) == "emulated"
    assert route(NV64, NV64, "emulated", dev) == "emulated"
    routes = route_module.recipe_routes(recipes.NVFP4_1x64(), "kernel", dev)
    assert routes == {"fprop": "kernel", "dgrad": "kernel", "wgrad": "kernel"}
    assert route_module.recipe_routes(recipes.NVFP4_1x64(), "emulated", dev)["fprop"] == "emulated"
    with pytest.raises(ValueError, match="no jf4_gemm kernel on"):
        route(NV, NV, "kernel", route_module.GemmDevice())


def test_auto_takes_the_kernel_where_the_operands_allow(rng, kernel_here):
    a, b = _operands(rng, "nvfp4-1x64")
    tn = prim.TN
    assert "jf4_gemm" in _primitives(lambda a, b: jax_fp4.scaled_dot_general(a, b, tn), a, b)
    assert "jf4_gemm" not in _primitives(lambda a, b: jax_fp4.scaled_dot_general(a, b, tn, implementation="emulated"),
                                         a, b)
    a3 = jq(_normal(rng, (2, M // 2, K)), MX4)
    b3 = jq(_normal(rng, (2, N, K)), MX4)
    batch = (((2,), (2,)), ((0,), (0,)))
    a64, b64 = jq(_normal(rng, (2, M // 2, K)), NV64), jq(_normal(rng, (2, N, K)), NV64)
    assert "jf4_gemm" not in _primitives(lambda a, b: jax_fp4.scaled_dot_general(a, b, batch), a64, b64)
    with pytest.raises(ValueError, match="no jf4_gemm kernel for"):
        jax_fp4.scaled_dot_general(a3, b3, batch, implementation="kernel")
    a64, bmx = jq(_normal(rng, (M, K)), NV64), jq(_normal(rng, (N, K)), MX4)
    assert "jf4_gemm" not in _primitives(lambda a, b: jax_fp4.scaled_dot_general(a, b, tn), a64, bmx)


@cpu_design
def test_kernel_refused_where_it_does_not_run(rng):
    a, b = _operands(rng, "mxfp8-e4m3")
    with pytest.raises(ValueError, match="no jf4_gemm kernel on"):
        jax_fp4.scaled_dot_general(a, b, prim.TN, implementation="kernel")
    x, w = jnp.ones((M, K), jnp.bfloat16), jnp.ones((K, N), jnp.bfloat16)
    with pytest.raises(ValueError, match="implementation='kernel' needs the jf4_gemm kernel"):
        jax_fp4.dense(x, w, recipe=recipes.MXFP8(), implementation="kernel")
    with pytest.raises(ValueError, match="implementation must be one of"):
        jax_fp4.dense(x, w, recipe=recipes.MXFP8(), implementation="cublas")
    with pytest.raises(ValueError, match=r"bias must be a float array of shape \(64,\)"):
        jax_fp4.scaled_dot_general(a, b, prim.TN, bias=jnp.zeros((M,)))


# (pair, lhs (input shape, block axis), rhs (input shape, block axis), dimension numbers, scale layout)
LAYOUTS = {
    "mxfp8 x.w[K,N] (w blocked along axis 0)": ("mxfp8-e4m3", ((M, K), -1), ((K, N), 0), (((1,), (0,)), ((), ()))),
    "mxfp8 e5m2 wgrad x.dy": ("mxfp8-e5m2 x e4m3", ((M, K), 0), ((M, N), 0), (((0,), (0,)), ((), ()))),
    "nvfp4 wgrad x.dy": ("nvfp4", ((M, K), 0), ((M, N), 0), (((0,), (0,)), ((), ()))),
    "nvfp4 x 2d w[K,N]": ("nvfp4 x 2d", ((M, K), -1), ((K, N), 0), (((1,), (0,)), ((), ()))),
    "nvfp4-1x64 x.w[K,N]": ("nvfp4-1x64", ((M, K), -1), ((K, N), 0), (((1,), (0,)), ((), ()))),
    "nvfp4 x mxfp8 x3.w[N,K]": ("nvfp4 x mxfp8", ((2, M // 2, K), -1), ((N, K), -1), (((2,), (1,)), ((), ()))),
}
LAYOUT_CASES = [(c, s) for c in LAYOUTS for s in ("compact", "swizzled")]


def _layout_operands(rng, case, layout, make):
    pair, (sa, axa), (sb, axb), dn = LAYOUTS[case]
    fa, fb = PAIRS[pair]

    def operand(shape, axis, fmt):
        x2 = make((int(np.prod(shape[:-1])), shape[-1]), axis if len(shape) == 2 else -1)
        return jq(x2.reshape(shape), fmt, axis, scale_layout=layout)

    return operand(sa, axa, fa), operand(sb, axb, fb), dn


@functools.partial(jax.jit, static_argnames=("dn", "out_dtype"))
def kernel_and_emulated(a, b, bias, dn, out_dtype=jnp.bfloat16):
    k = jax_fp4.scaled_dot_general(a, b, dn, out_dtype, implementation="kernel", bias=bias, return_amax=True)
    e = jax_fp4.scaled_dot_general(a, b, dn, out_dtype, implementation="emulated", bias=bias, return_amax=True)
    return k, e


@cpu_design
@pytest.mark.parametrize("case,layout", LAYOUT_CASES, ids=[f"{c}-{s}" for c, s in LAYOUT_CASES])
def test_layout_conversions_give_the_emulated_product(rng, kernel_here, case, layout):
    """Exactly summable inputs: the kernel route (its operands converted to K-major compact scales) equals the
    emulated route on the stored layouts bit for bit, with a bias, bfloat16 output and the output amax."""
    a, b, dn = _layout_operands(rng, case, layout, lambda shape, axis: exact_input(rng, shape, axis))
    assert (a.scale_layout, b.scale_layout) == (layout, layout)
    out_shape = jax.eval_shape(lambda a, b: jax_fp4.scaled_dot_general(a, b, dn), a, b).shape
    bias = jnp.asarray(rng.integers(-4, 5, out_shape[-1]), jnp.float32)
    (k, k_amax), (e, e_amax) = kernel_and_emulated(a, b, bias, dn)
    assert k.shape == out_shape and k.dtype == jnp.bfloat16
    np.testing.assert_array_equal(bits(k), bits(e))
    assert float(k_amax) == float(e_amax) > 0


@cpu_design
@pytest.mark.parametrize("case", ["mxfp8 x.w[K,N] (w blocked along axis 0)", "nvfp4 wgrad x.dy"])
def test_layout_conversions_within_the_bound_on_random_inputs(rng, kernel_here, case):
    a, b, dn = _layout_operands(rng, case, "swizzled", lambda shape, axis: _normal(rng, shape))
    (k, _), _ = kernel_and_emulated(a, b, None, dn, out_dtype=jnp.float32)
    ref, bound = operand_bound(a, b, dn, a.shape[dn[0][0][0]])
    assert_within(k, ref, bound, case)


def test_rht_pair_on_the_kernel_route(rng, kernel_here):
    x, dy = _normal(rng, (M, K)), _normal(rng, (M, N))
    a, b = jq(x, NVRHT, 0), jq(dy, NVRHT, 0)
    dn = (((0,), (0,)), ((), ()))
    (k, _), (e, _) = kernel_and_emulated(a, b, None, dn, out_dtype=jnp.float32)
    ref, bound = operand_bound(a, b, dn, M)
    assert_within(k, ref, bound, "rht kernel route")


@functools.partial(jax.jit, static_argnames=("recipe", "implementation"))
def dense_vjp(x, w, b, dy, key, recipe, implementation):
    y, vjp = jax.vjp(lambda x, w, b: jax_fp4.dense(x, w, b, recipe=recipe, key=key, implementation=implementation),
                     x, w, b)
    return (y, *vjp(dy))


@pytest.mark.parametrize("name", ["nvfp4-fwd-mxfp8-bwd", "nvfp4-1x64"])
def test_dense_kernel_route_equals_emulated_on_the_cpu(rng, kernel_here, name):
    """On the CPU the kernel route of dense (packed operands, no exact operands, bias in the epilogue) computes the
    emulated bits: the primitive's lowering is the emulation."""
    _assert_dense_route_is_emulated_bits(rng, recipes.by_name(name), "kernel", 3)


def _assert_dense_route_is_emulated_bits(rng, recipe, implementation, seed):
    """dense fwd + bwd on `implementation` runs jf4_gemm (its CPU lowering) and gives the all-emulated results.

    Both routes hand XLA's dot the same operand values; the two programs may accumulate a dot's fp32 sum in another
    order, which moves it by far less than one bf16 step (K = 256 products of operands within a few units), so a
    GEMM output (y, dx, dw) may differ by one bf16 rounding step where its fp32 sum sits at a rounding boundary and is
    otherwise bit-equal; dbias (the quantize pass's column sums, the same in both) must be bit-equal.
    """
    x, w, b, dy = _normal(rng, (M, K)), _normal(rng, (K, N)) / 8, _normal(rng, (N,)), _normal(rng, (M, N))
    key = jax.random.key(seed)
    assert "jf4_gemm" in _primitives(lambda *a: dense_vjp(*a, recipe, implementation), x, w, b, dy, key)
    got, want = dense_vjp(x, w, b, dy, key, recipe, implementation), dense_vjp(x, w, b, dy, key, recipe, "emulated")
    for name_, g, e in zip(("y", "dx", "dw", "dbias"), got, want, strict=True):
        gb, eb = bits(g).astype(np.int64), bits(e).astype(np.int64)
        if name_ == "dbias":
            np.testing.assert_array_equal(gb, eb, err_msg=name_)
            continue
        steps = np.abs(gb - eb)  # same sign (a one-step flip keeps it), so bit distance = rounding steps
        assert steps.max() <= 1 and np.mean(steps != 0) < 0.01, (name_, int(steps.max()), float(np.mean(steps != 0)))


def test_dense_auto_mixes_kernel_and_emulated_routes_on_the_cpu(rng, monkeypatch):
    """nvfp4-1x64 under "auto" where the kernel runs: fprop on jf4_gemm (a 1x64 pair), dgrad / wgrad emulated (NVFP4
    1D pairs, with exact operands), the same bits as the all-emulated step."""
    monkeypatch.setattr(route_module, "kernel_gemm_available", lambda: True)
    recipe = recipes.by_name("nvfp4-1x64")
    assert gemm_routes(recipe)["fprop"] == "kernel" and gemm_routes(recipe)["dgrad"] == "emulated"
    _assert_dense_route_is_emulated_bits(rng, recipe, "auto", 5)


# ---- GPU: the jf4_gemm kernel -----------------------------------------------------------------------------------
def _needs_kernel():
    if not route_module.kernel_gemm_available():
        pytest.skip("no jf4_gemm kernel on this device (compute capability 9.x and the CUDA extension needed)")


GPU_SHAPES = [(128, 128, 64), (200, 320, 80), (64, 1024, 384)]  # (M, K, N); odd M / N exercise the edge tiles


@pytest.mark.gpu
@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_within_the_bound(rng, pair, shape):
    _needs_kernel()
    m, k, n = shape
    fa, fb = PAIRS[pair]
    if fa.local_1x64 and (m % 64 or n % 64):
        m, n = 64 * -(-m // 64), 64 * -(-n // 64)
    a, b = jq(_normal(rng, (m, k)), fa), jq(_normal(rng, (n, k)), fb)
    for out_dtype in (jnp.float32, jnp.bfloat16):
        (kout, _), (eout, _) = kernel_and_emulated(a, b, None, prim.TN, out_dtype)
        ref, kb = operand_bound(a, b, prim.TN, k, kernel=True)
        _, eb = operand_bound(a, b, prim.TN, k)
        if out_dtype == jnp.bfloat16:
            kb, eb = cast_bound(ref, kb, out_dtype), cast_bound(ref, eb, out_dtype)
        assert_within(kout, ref, kb, f"kernel {pair} {shape} {jnp.dtype(out_dtype).name}")
        assert_within(kout, np.asarray(eout, np.float64), kb + eb, f"kernel vs emulated {pair} {shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("case,layout", LAYOUT_CASES, ids=[f"{c}-{s}" for c, s in LAYOUT_CASES])
def test_kernel_exact_on_exactly_summable_inputs(rng, case, layout):
    _needs_kernel()
    a, b, dn = _layout_operands(rng, case, layout, lambda shape, axis: exact_input(rng, shape, axis))
    bias = jnp.asarray(rng.integers(-4, 5, jax.eval_shape(
        lambda a, b: jax_fp4.scaled_dot_general(a, b, dn), a, b).shape[-1]), jnp.float32)
    (k, k_amax), (e, e_amax) = kernel_and_emulated(a, b, bias, dn)
    if a.fmt.local_1x64:  # the window decode factors 1 / S_enc,w round: bound only
        ref, bound = operand_bound(a, b, dn, K, kernel=True)
        ref = ref + np.asarray(bias, np.float64)
        assert_within(k, ref, cast_bound(ref, bound, jnp.bfloat16, added_in_f32=True), case)
        return
    np.testing.assert_array_equal(bits(k), bits(e))
    assert float(k_amax) == float(e_amax)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mxfp8", "mxfp8-hybrid", "nvfp4", "nvfp4-fwd-mxfp8-bwd", "nvfp4-1x64"])
def test_dense_on_the_kernel(rng, name):
    """dense fwd + bwd on jf4_gemm: y, dx, dw, dbias against float64 products of the reproduced operands within the
    kernel's bounds, and against the emulated route within the sum of both bounds."""
    _needs_kernel()
    recipe = recipes.by_name(name)
    x, w, b, dy = _normal(rng, (M, K)), _normal(rng, (K, N)) / 8, _normal(rng, (N,)), _normal(rng, (M, N))
    key = jax.random.key(int(rng.integers(2**31)))
    outs = dense_vjp(x, w, b, dy, key, recipe, "kernel")
    assert "jf4_gemm" in _primitives(lambda *a: dense_vjp(*a, recipe, "kernel"), x, w, b, dy, key)
    ops = dense_operands(x, w, dy, key, recipe)
    kchecked = check_dense(outs, ops, b, dy, f"{name} kernel", kernel=True)
    emulated = dense_vjp(x, w, b, dy, key, recipe, "emulated")
    echecked = check_dense(emulated, ops, b, dy, f"{name} emulated")
    for i, g in enumerate(("y", "dx", "dw")):
        assert_within(outs[i], np.asarray(emulated[i], np.float64), kchecked[g][1] + echecked[g][1],
                      f"{name} {g}: kernel vs emulated")


# ---- sharding (4 forced CPU devices, in a subprocess: XLA_FLAGS must precede the backend) ----------------------------
SHARDING_SCRIPT = """
import re, sys
sys.path.insert(0, {tests!r})
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from _gemm_util import check_dense, dense_operands, operand_bound, assert_within
import jax_fp4
from jax_fp4 import route, recipes, MXFP8, NVFP4

route.kernel_gemm_available = lambda: True  # the primitive lowers to the emulation on the CPU
rng = np.random.default_rng({seed})
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
M, K, N = 256, 128, 128
x = jnp.asarray(rng.standard_normal((M, K)) * np.repeat(2.0 ** np.arange(-2, 2), 64)[:, None], jnp.bfloat16)
w = jnp.asarray(rng.standard_normal((K, N)) / 8, jnp.bfloat16)
b = jnp.asarray(rng.standard_normal(N), jnp.bfloat16)
dy = jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16)
TN = (((1,), (1,)), ((), ()))
for fa, fb in ((NVFP4(), MXFP8()), (NVFP4(local_1x64=True), NVFP4(local_1x64=True))):
    a, c = jax_fp4.quantize(x, fa), jax_fp4.quantize(w.T, fb)
    put = lambda q, ax: jax.tree.map(lambda l: jax.device_put(l, NamedSharding(mesh, P(ax, None) if l.ndim == 2
                                                                                   else P())), q)
    f = jax.jit(lambda a, c: jax_fp4.scaled_dot_general(a, c, TN, implementation="kernel", return_amax=True))
    sa, sc = put(a, "data"), put(c, "model")
    out, amax = f(sa, sc)
    assert out.sharding.spec == P("data", "model"), out.sharding
    hlo = f.lower(sa, sc).compile().as_text()
    assert not re.search(r"all-gather|all-to-all|collective-permute|reduce-scatter", hlo), "a gathered operand"
    ref, bound = operand_bound(a, c, TN, K)
    assert_within(out, ref, bound, f"sharded {{fa!r}} x {{fb!r}}")
    assert float(amax) == float(jnp.max(jnp.abs(out)))

def step(x, w, b, dy):
    y, vjp = jax.vjp(lambda x, w, b: jax_fp4.dense(x, w, b, recipe=recipes.NVFP4Fwd_MXFP8Bwd(),
                                                    implementation="kernel"), x, w, b)
    return (y, *vjp(dy))

outs = jax.jit(step)(jax.device_put(x, NamedSharding(mesh, P("data", None))), w, b,
                     jax.device_put(dy, NamedSharding(mesh, P("data", None))))
assert outs[0].sharding.spec[0] == "data", outs[0].sharding
check_dense(outs, dense_operands(x, w, dy, jax.random.key(0), recipes.NVFP4Fwd_MXFP8Bwd()), b, dy, "sharded dense")
print("OK")
"""


@pytest.mark.slow  # a 4-device subprocess: the full suite, not the quick tier
def test_sharded_kernel_route_in_a_subprocess(rng):
    """M / N sharded operands run the primitive per shard without gathering them (no all-gather in the compiled
    HLO; the amax is one all-reduce), within the bound of the unsharded product; sharded dense on the kernel route
    within check_dense's bounds."""
    import os
    import pathlib
    import subprocess
    import sys

    tests = str(pathlib.Path(__file__).resolve().parent)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(pathlib.Path(tests).parent), os.environ.get("PYTHONPATH", "")]))
    script = SHARDING_SCRIPT.format(tests=tests, seed=int(rng.integers(2**31)))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
