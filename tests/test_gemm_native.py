"""The native GEMM route (`jax.nn.scaled_matmul`) against the emulated route, run on the CPU.

implementation="native" may be requested wherever `jax.nn.scaled_matmul` lowers. On the CPU that is jax >= 0.11
(XLA's dequantize + float32 dot decomposition); with older jax the function is replaced by its documented semantics
(`documented_scaled_matmul`: the same decomposition written with jnp), so the route's operand layouts (data and
compact scales with the contracting axis last, the NVFP4 tensor scales applied afterwards) are checked either way.

Bound: both routes sum the same exact terms (value(q) * block scale products: <= 12 significant bits) in float32, in
different orders, and multiply the result by the same NVFP4 tensor scales, so each is within `gemm_bound` (derived in
_gemm_util from K and A = sum |a_k b_k|: gamma_K for any summation order, plus 2 roundings per tensor scale) of the
exact product E, and |native - emulated| <= 2 * gemm_bound. Nothing is tuned.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _gemm_util import (
    assert_within,
    documented_scaled_matmul,
    dot64,
    f64,
    operand_bound,
    violates,
)
from _quantize_util import jq

import jax_fp4
from jax_fp4 import MXFP8, NVFP4
from jax_fp4 import route as route_module

M, K, N = 64, 128, 32
KEY = jax.random.key(11)

# name -> (lhs operand, rhs operand, dimension_numbers, contracted length); inputs x[M, K], w[K, N], wt[N, K], dy[M, N]
ORIENTATIONS = {
    "x.w[K,N]": (("x", -1), ("w", 0), (((1,), (0,)), ((), ())), K),
    "x.w[N,K]": (("x", -1), ("wt", -1), (((1,), (1,)), ((), ())), K),
    "wgrad x.dy": (("x", 0), ("dy", 0), (((0,), (0,)), ((), ())), M),
}
MX4, MX5 = MXFP8(), MXFP8(element="e5m2")
# Every format pairing the native route takes (jax_fp4.route.native_formats_ok): MXFP8 x MXFP8 with either element
# type on either side, NVFP4 1D x NVFP4 1D (stochastic rounding changes only the quantization, not the operands'
# layout).
NATIVE_PAIRS = {
    "mxfp8 e4m3 x e4m3": (MX4, MX4),
    "mxfp8 e5m2 x e4m3": (MX5, MX4),
    "mxfp8 e4m3 x e5m2": (MX4, MX5),
    "mxfp8 e5m2 x e5m2": (MX5, MX5),
    "nvfp4 1d x 1d": (NVFP4(), NVFP4()),
    "nvfp4 sr x 1d": (NVFP4(stochastic_rounding=True), NVFP4()),
}
CASES = [(p, o) for p in NATIVE_PAIRS for o in ORIENTATIONS]


@pytest.fixture
def cpu_scaled_matmul(monkeypatch):
    """jax.nn.scaled_matmul as it is where it lowers on the CPU, its documented semantics where it does not."""
    if not route_module.scaled_matmul_lowers():
        monkeypatch.setattr(jax.nn, "scaled_matmul", documented_scaled_matmul)
    assert route_module.scaled_matmul_lowers()


def _operands(rng, pair, orient):
    """bfloat16 inputs (standard normal rows scaled by 2**[-3, 3]: varied block scales), quantized as the pair says."""
    def mk(shape):
        return jnp.asarray(rng.standard_normal(shape) * 2.0 ** rng.uniform(-3, 3, (shape[0], 1)), jnp.bfloat16)

    xs = {"x": mk((M, K)), "w": mk((K, N)), "wt": mk((N, K)), "dy": mk((M, N))}
    (na, axa), (nb, axb), dn, k = ORIENTATIONS[orient]
    fa, fb = NATIVE_PAIRS[pair]
    ka, kb = jax.random.split(KEY)
    a, b = jq(xs[na], fa, axa, ka), jq(xs[nb], fb, axb, kb)
    return a, b, dn, k, (xs[na], xs[nb])


@functools.partial(jax.jit, static_argnames=("dimension_numbers", "implementation"))
def jgemm(a, b, dimension_numbers, implementation):
    return jax_fp4.scaled_dot_general(a, b, dimension_numbers, implementation=implementation)


@pytest.mark.parametrize("pair,orient", CASES, ids=[f"{p}-{o}" for p, o in CASES])
def test_native_matches_emulated(rng, cpu_scaled_matmul, pair, orient):
    a, b, dn, k, raw = _operands(rng, pair, orient)
    native, emulated = jgemm(a, b, dn, "native"), jgemm(a, b, dn, "emulated")
    assert native.dtype == emulated.dtype == jnp.float32 and native.shape == emulated.shape
    ref, bound = operand_bound(a, b, dn, k)
    assert_within(native, ref, bound, f"native {pair} {orient} vs the exact product")
    assert_within(native, f64(emulated), 2 * bound, f"native {pair} {orient} vs emulated")
    # the bound is tight enough to reject the unquantized product (a layout mix-up is further off still)
    assert violates(dot64(f64(raw[0]), f64(raw[1]), dn)[0], ref, bound)


@pytest.mark.parametrize("pair,orient", [("nvfp4 1d x 1d", "x.w[K,N]"), ("mxfp8 e5m2 x e4m3", "wgrad x.dy")])
def test_native_with_swizzled_scales(rng, cpu_scaled_matmul, pair, orient):
    a, b, dn, _, _ = _operands(rng, pair, orient)
    sa, sb = jax_fp4.swizzle_scales(a), jax_fp4.swizzle_scales(b)
    assert sa.scale_layout == sb.scale_layout == "swizzled"
    np.testing.assert_array_equal(f64(jgemm(sa, sb, dn, "native")), f64(jgemm(a, b, dn, "native")))


def test_native_refused_without_a_lowering(rng, monkeypatch):
    def no_lowering(*args, **kwargs):
        raise NotImplementedError("MLIR translation rule for primitive 'scaled_matmul' not found")

    monkeypatch.setattr(jax.nn, "scaled_matmul", no_lowering)
    assert not route_module.scaled_matmul_lowers()
    a, b, dn, _, _ = _operands(rng, "mxfp8 e4m3 x e4m3", "x.w[K,N]")
    with pytest.raises(ValueError, match="jax.nn.scaled_matmul does not lower on"):
        jax_fp4.scaled_dot_general(a, b, dn, implementation="native")
    assert jax_fp4.scaled_dot_general(a, b, dn).shape == (M, N)  # auto: emulated


def test_auto_stays_emulated_below_compute_capability_10(rng, cpu_scaled_matmul, monkeypatch):
    """auto takes the native route only where native_gemm_available() (compute capability >= 10): not on the CPU,
    even where jax.nn.scaled_matmul lowers there; gemm_route (the environment report's source) says the same."""
    assert not route_module.native_gemm_available()
    calls = []
    original = jax.nn.scaled_matmul

    def recorder(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "scaled_matmul", recorder)
    a, b, dn, _, _ = _operands(rng, "nvfp4 1d x 1d", "x.w[K,N]")
    jax.eval_shape(lambda a, b: jax_fp4.scaled_dot_general(a, b, dn), a, b)
    assert calls == []
    jax.eval_shape(lambda a, b: jax_fp4.scaled_dot_general(a, b, dn, implementation="native"), a, b)
    assert calls  # the same operands do take it when asked
    for fa, fb in NATIVE_PAIRS.values():
        assert route_module.gemm_route(fa, fb) == "emulated"
    assert route_module.gemm_route(None, None) == "bf16"


def test_gemm_route_on_compute_capability_10(monkeypatch):
    monkeypatch.setattr(route_module, "native_gemm_available", lambda: True)
    for fa, fb in NATIVE_PAIRS.values():
        assert route_module.gemm_route(fa, fb) == "native"
    for fa, fb in [(NVFP4(), NVFP4(scaling_2d=True)), (NVFP4(rht=True), NVFP4(rht=True)),
                   (NVFP4(local_1x64=True), NVFP4(local_1x64=True)), (NVFP4(), MX4)]:
        assert route_module.gemm_route(fa, fb) == "emulated"
