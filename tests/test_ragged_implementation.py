"""`implementation=` of the grouped GEMMs (`jax_fp4._src.emulation.ragged`): "xla" (`lax.ragged_dot_general`) or
"tokamax" (tokamax's grouped-GEMM kernels on GPUs, its XLA implementation elsewhere).

* On the CPU tokamax runs its XLA implementation, so "tokamax" gives "xla"'s bits: values and gradients of
  `jax_fp4.ragged_dot` for BF16 and quantized recipes, and of `MoEMLP`, under jit;
* on a GPU (marker gpu) tokamax's kernels and XLA's lowering are two GEMM libraries over the same exact operands with
  float32 accumulation: they agree to the float32 summation bound over the contracted length (K, N, or the group's
  rows) plus each result's one rounding to bfloat16;
* ExpertParallelMoEMLP on a data x expert mesh of forced CPU devices: "tokamax" (a shard_map that does not check
  varying axes) against "xla";
* errors: an unknown implementation, "tokamax" without tokamax (ImportError naming the extra), and a tokamax release
  that does not run under the installed jax (ImportError naming both versions).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from jax_fp4 import recipes

tokamax = pytest.importorskip("tokamax")

T, K, N, G = 160, 64, 96, 4
SIZES = np.array([32, 0, 64, 32], np.int32)  # empty group, rows past the last group
RECIPES = ("bf16", "mxfp8", "nvfp4-fwd-mxfp8-bwd", "nvfp4")


def _data(seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((G, K, N)) * K**-0.5, jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((T, N)), jnp.bfloat16)
    return x, w, dy, jax.random.key(int(rng.integers(2**31)))


@functools.partial(jax.jit, static_argnames=("recipe", "implementation"))
def _vjp(x, w, dy, key, recipe, implementation):
    f = lambda x, w: jax_fp4.ragged_dot(x, w, jnp.asarray(SIZES), recipe=recipe, key=key,  # noqa: E731
                                        implementation=implementation)
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy))


def _bits(a):
    return np.asarray(a).view(np.uint16)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="tokamax runs its XLA implementation on the CPU only")
@pytest.mark.parametrize("recipe", RECIPES)
def test_tokamax_equals_xla_on_the_cpu(recipe):
    x, w, dy, key = _data(sum(map(ord, recipe)))
    ref = _vjp(x, w, dy, key, recipes.by_name(recipe), "xla")
    got = _vjp(x, w, dy, key, recipes.by_name(recipe), "tokamax")
    for name, a, b in zip(("y", "dx", "dw"), ref, got, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{recipe} {name}")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="tokamax runs its XLA implementation on the CPU only")
def test_moe_layer_with_tokamax_equals_xla_on_the_cpu():
    from flax import nnx

    from jax_fp4.flax.moe import MoEMLP

    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 32, 64)), jnp.bfloat16)

    def run(implementation):
        m = MoEMLP(64, 64, 4, recipe=recipes.by_name("nvfp4-fwd-mxfp8-bwd"), top_k=2, dtype=jnp.bfloat16,
                   implementation=implementation, rngs=nnx.Rngs(params=0, quantize=1))
        loss = lambda m, x: jnp.sum(m(x).astype(jnp.float32) ** 2)  # noqa: E731
        val, g = nnx.jit(nnx.value_and_grad(loss))(m, x)
        return val, jax.tree.leaves(nnx.state(g))

    (v0, g0), (v1, g1) = run("xla"), run("tokamax")
    assert float(v0) == float(v1)
    for a, b in zip(g0, g1, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("recipe", RECIPES)
def test_tokamax_against_xla_on_the_gpu(recipe):
    """Both are float32 sums of the same n exact products (n the contracted length: K, N, or a group's rows), so
    each is within gamma_n * sum|terms| of the exact sum (Higham eq. 3.5, gamma_n = n u / (1 - n u), u = 2^-24), and
    sum|terms| <= n * A * B with A, B bounds of the decoded operands: a decoded block-scaled value exceeds its
    tensor's amax by at most its scale's rounding (E4M3 block scale: 2^-4 relative; E8M0 with E4M3 codes: the
    codes' 2^-4), so A = 1.25 max|operand| covers every recipe. Each result is then rounded once to bfloat16
    (at most 2^-8 relative)."""
    x, w, dy, key = _data(sum(map(ord, recipe)))
    ref = _vjp(x, w, dy, key, recipes.by_name(recipe), "xla")
    got = _vjp(x, w, dy, key, recipes.by_name(recipe), "tokamax")
    amax = {k: 1.25 * float(jnp.max(jnp.abs(v.astype(jnp.float32)))) for k, v in (("x", x), ("w", w), ("dy", dy))}
    u = 2.0**-24
    cases = (("y", K, amax["x"] * amax["w"]), ("dx", N, amax["dy"] * amax["w"]),
             ("dw", int(SIZES.max()), amax["x"] * amax["dy"]))
    for (name, n, ab), a, b in zip(cases, ref, got, strict=True):
        gamma = n * u / (1 - n * u)
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        bound = 2 * gamma * n * ab + 2.0**-8 * (np.abs(a) + np.abs(b))
        assert np.all(np.abs(a - b) <= bound), f"{recipe} {name}: max excess {np.max(np.abs(a - b) - bound)}"


def test_errors(monkeypatch):
    x, w, _, _ = _data(0)
    with pytest.raises(ValueError, match=r"implementation must be one of \('xla', 'tokamax'\)"):
        jax_fp4.ragged_dot(x, w, SIZES, recipe="bf16", implementation="cuda")
    import sys

    monkeypatch.setitem(sys.modules, "tokamax", None)  # as if not installed
    with pytest.raises(ImportError, match=r"jax_fp4\[tokamax\]"):
        jax_fp4.ragged_dot(x, w, SIZES, recipe="bf16", implementation="tokamax")
    from flax import nnx

    from jax_fp4.flax.moe import MoEMLP

    with pytest.raises(ImportError, match=r"jax_fp4\[tokamax\]"):
        MoEMLP(64, 64, 4, recipe=recipes.by_name("bf16"), implementation="tokamax", rngs=nnx.Rngs(0))



EP_SCRIPT = """
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from jax_fp4 import recipes
from jax_fp4.flax.moe import MoEMLP
from jax_fp4.flax.moe_ep import ExpertParallelMoEMLP

mesh = jax.make_mesh((2, 2), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 16, 64)), jnp.bfloat16)
xs = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
loss = lambda m, x: jnp.sum(m(x).astype(jnp.float32) * jnp.cos(jnp.arange(64.0)))  # noqa: E731


def run(m, x):
    val, (g, dx) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(m, x)
    grads = {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(g))}
    return np.asarray(val), grads, np.asarray(dx)


def same(a, b):
    return bool(np.array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8)))


out = {}
for name in ("bf16", "nvfp4-fwd-mxfp8-bwd"):  # bf16 dispatch; quantized dispatch
    args = dict(recipe=recipes.by_name(name), top_k=2, dtype=jnp.bfloat16)  # every layer: the same initial values
    (v0, g0, dx0), (v1, g1, dx1) = (
        run(ExpertParallelMoEMLP(64, 64, 8, mesh=mesh, batch_axes=("data", "expert"), implementation=i,
                                 rngs=nnx.Rngs(params=0, quantize=1), **args), xs)
        for i in ("xla", "tokamax"))
    # each data replica's half through the replicated layer: its expert gradients a and b
    halves = [run(MoEMLP(64, 64, 8, rngs=nnx.Rngs(params=0, quantize=1), **args), h)[1] for h in (x[:4], x[4:])]
    experts = [k for k in g0 if "up" in k or "down" in k]
    excess = {}  # |g - (a + b)| over 2 u (|a| + |b|) (1 + u), u = 2^-8, for xla and tokamax
    for k in experts:
        a, b = (h[k].astype(np.float64) for h in halves)
        bound = np.maximum(2 * 2.0**-8 * (abs(a) + abs(b)) * (1 + 2.0**-8), 1e-30)
        excess[k] = [float(np.max(np.abs(g[k] - (a + b)) / bound)) for g in (g0, g1)]
    out[name] = dict(loss=same(v0, v1), dx=same(dx0, dx1), excess=excess,
                     experts={k: same(g0[k], g1[k]) for k in experts},
                     others={k: same(g0[k], g1[k]) for k in g0 if k not in experts})
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="tokamax runs its XLA implementation on the CPU only")
def test_expert_parallel_with_tokamax_on_cpu_devices():
    """ExpertParallelMoEMLP on a data x expert mesh (2 x 2 forced CPU devices), "tokamax" against "xla", for the bf16
    and the quantized dispatch. With tokamax the shard_map does not check varying axes (tokamax's kernels declare
    none), and its transpose, not the body's, sums the experts' gradients over the data axis: the loss, dx and the
    router and norm gradients equal "xla"'s bit for bit; with the bf16 dispatch each expert kernel's gradient is, as
    "xla"'s, the sum of the two replicas' gradients a + b within the roundings to bfloat16, 2 u (|a| + |b|) (1 + u)
    with u = 2^-8 (docs/numerics.md section 9), the two rounding at different places; with the quantized dispatch
    the expert gradients equal "xla"'s bit for bit."""
    from _cpu_devices import run_results

    (out,) = run_results(EP_SCRIPT, devices=4)
    for name, r in out.items():
        assert r["loss"] and r["dx"] and r["others"] and all(r["others"].values()), (name, r)
        if name == "bf16":  # the bf16 dispatch: both within the rounding bound of a + b
            assert all(e <= 1 for pair in r["excess"].values() for e in pair), (name, r["excess"])
        else:  # the quantized dispatch's wgrad sums its float32 partials the same way in both
            assert r["experts"] and all(r["experts"].values()), (name, r["experts"])


def test_tokamax_and_jax_releases():
    """tokamax <= 0.0.12 passes the Pallas Mosaic GPU kernel `out_shape=` that jax 0.11 removed; tokamax >= 0.0.13
    needs jax >= 0.11: a mismatched pair is refused with both versions named, a matched one (the installed) passes."""
    from jax_fp4._src.emulation import ragged

    assert ragged._version_pair(jax.__version__, tokamax.__version__) is None  # pip resolved a matching pair
    assert ragged._version_pair("0.10.2", "0.0.12") is None
    assert ragged._version_pair("0.11.2", "0.0.17") is None
    assert ragged._version_pair("0.12.0", "0.0.13") is None
    msg = ragged._version_pair("0.11.2", "0.0.12")
    assert "tokamax 0.0.12 does not run under jax 0.11.2" in msg and ">= 0.0.13" in msg
    assert "<= 0.0.12" in ragged._version_pair("0.10.2", "0.0.17")
