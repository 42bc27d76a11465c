"""`jax_fp4.flax.moe_ep.ExpertParallelMoEMLP` on 4 forced CPU devices against the replicated `MoEMLP`.

* expert mesh (4): the output y, the input gradient dx and every parameter gradient equal MoEMLP's on the whole batch
  bit for bit (the expert kernels' bf16 gradients compared in bf16: XLA may fold MoEMLP's final cast into its dot), for bf16, mxfp8, nvfp4-fwd-mxfp8-bwd and nvfp4-no-sr (every group holds the unsharded group's rows,
  in order, with the same padding; docs/numerics.md "Expert parallelism");
* data x expert mesh (2 x 2): each data replica's experts see that replica's tokens, so y equals MoEMLP applied to
  each replica's half of the batch (bit for bit; NVFP4 included: the tensor amaxes are the replica's), an expert
  kernel's gradient is the sum of the two halves' gradients a + b within the roundings to the compute dtype bfloat16
  (2^-8 (|a| + |b|) + 2^-9 |a + b|: each half and the sum rounded once, or kept in float32 where XLA folds the
  casts); bf16 / mxfp8: dx and the router and norm gradients equal the whole batch's bit for bit;
* uneven routing: every token routed to one expert (the others empty), dropless;
* capacity_factor: the buffers shrink and the assignments past the capacity are dropped (their terms leave y);
* the dispatch moves the compute dtype: the compiled step's all-to-alls read from the HLO;
* construction / trace-time errors.
"""

from __future__ import annotations

import textwrap

import pytest

from _cpu_devices import run_results

pytest.importorskip("flax")

SCRIPT = textwrap.dedent(
    """
    import json, re, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_fp4 import recipes
    from jax_fp4.flax.moe import MoEMLP
    from jax_fp4.flax.moe_ep import ExpertParallelMoEMLP

    D, H, E, K = 64, 64, 8, 2
    C = jnp.cos(jnp.arange(D, dtype=jnp.float32))

    def loss(m, x):
        y, aux = m(x, return_aux_loss=True)
        return jnp.sum(y.astype(jnp.float32) * C) + aux, y

    grad = nnx.jit(lambda m, x: nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(m, x))

    def run(m, x):
        (_, y), (g, dx) = grad(m, x)
        return np.asarray(y, np.float32), np.asarray(dx, np.float32), {
            jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(g))}

    def layers(name, shape, x_rng=1, **kw):
        mesh = jax.make_mesh(shape, ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        args = dict(recipe=recipes.by_name(name), top_k=K, dtype=jnp.bfloat16)
        ref = MoEMLP(D, H, E, rngs=nnx.Rngs(params=0, quantize=1), **args)
        ep = ExpertParallelMoEMLP(D, H, E, mesh=mesh, batch_axes=("data", "expert"),
                                  rngs=nnx.Rngs(params=0, quantize=1), **args, **kw)
        x = jnp.asarray(np.random.default_rng(x_rng).standard_normal((8, 16, D)), jnp.bfloat16)
        return mesh, ref, ep, x

    def same(a, b):
        return bool(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)))

    def bf16(a):  # the expert kernels' gradients are bf16 products (compute dtype), widened to the f32 parameters;
        return np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32))  # XLA may fold that cast away

    def same_grads(g0, g1):
        return {k: same(bf16(g0[k]), g1[k]) if ("up" in k or "down" in k) else same(g0[k], g1[k]) for k in g0}

    out = {}
    for name in ("bf16", "mxfp8", "nvfp4-fwd-mxfp8-bwd", "nvfp4-no-sr"):  # expert axis 4: the unsharded bits
        mesh, ref, ep, x = layers(name, (1, 4))
        y0, dx0, g0 = run(ref, x)
        y1, dx1, g1 = run(ep, jax.device_put(x, NamedSharding(mesh, P(("data", "expert")))))
        out[name] = dict(y=same(y0, y1), dx=same(dx0, dx1), grads=same_grads(g0, g1))

    for name in ("bf16", "mxfp8", "nvfp4-fwd-mxfp8-bwd"):  # data x expert: per data replica
        mesh, ref, ep, x = layers(name, (2, 2))
        y0, dx0, g0 = run(ref, x)
        halves = [run(ref, x[:4]), run(ref, x[4:])]
        y1, dx1, g1 = run(ep, jax.device_put(x, NamedSharding(mesh, P(("data", "expert")))))
        experts = [k for k in g0 if "up" in k or "down" in k]
        excess = {}  # |g - (a + b)| over its bound 2^-8 (|a| + |b|) + 2^-9 |a + b| (max over the kernel: <= 1)
        for k in experts:
            a, b = (h[2][k].astype(np.float64) for h in halves)
            excess[k] = float(np.max(np.abs(g1[k] - (a + b)) / (2.0**-8 * (abs(a) + abs(b)) + 2.0**-9 * abs(a + b)
                                                                   + 1e-30)))
        out[name + " 2x2"] = dict(y=same(np.concatenate([h[0] for h in halves]), y1), dx=same(dx0, dx1),
                                  excess=excess, other_grads={k: same(g0[k], g1[k]) for k in g0 if k not in experts})

    # Uneven routing: the router sends every token to expert 5 first (experts 5 and one other per token).
    mesh, ref, ep, x = layers("mxfp8", (1, 4))
    for m in (ref, ep):
        m.router.kernel[...] = jnp.zeros((D, E)).at[:, 5].set(1.0)
    x = jnp.abs(x) + 0.1
    y0, dx0, g0 = run(ref, x)
    y1, dx1, g1 = run(ep, jax.device_put(x, NamedSharding(mesh, P(("data", "expert")))))
    out["one expert"] = dict(y=same(y0, y1), dx=same(dx0, dx1), grads=same_grads(g0, g1))

    # A capacity factor: per (source, destination) pair ceil(0.5 * 32 * 2 / 4) = 8 rows; past them, dropped.
    mesh, ref, ep, x = layers("bf16", (1, 4), capacity_factor=0.5)
    xs = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
    y1 = np.asarray(nnx.jit(lambda m, x: m(x))(ep, xs), np.float32).reshape(4, 32, D)
    e = nnx.jit(lambda m, x: m.route(m.norm(x).reshape(-1, D))[2])(ref, x)
    e = np.asarray(e).reshape(4, 32, K)
    kept = np.zeros(e.shape, bool)
    for s in range(4):  # each device's assignments in (token, slot) order, the first 8 per destination kept
        fill = np.zeros(4, int)
        for t in range(32):
            for j in range(K):
                kept[s, t, j] = fill[e[s, t, j] // 2] < 8
                fill[e[s, t, j] // 2] += 1

    class Dropped(MoEMLP):  # MoEMLP with the dropped assignments' routing weights zeroed
        def route(self, x2):
            probs, w, e = super().route(x2)
            return probs, w * self.kept[...], e

    ref = Dropped(D, H, E, recipe=recipes.BF16(), top_k=K, dtype=jnp.bfloat16, rngs=nnx.Rngs(params=0, quantize=1))
    ref.kept = nnx.Variable(jnp.asarray(kept.reshape(-1, K), jnp.float32))
    y0 = np.asarray(nnx.jit(lambda m, x: m(x))(ref, x), np.float32).reshape(4, 32, D)
    out["capacity"] = dict(dropped=int((~kept).sum()), y=same(y0, y1))

    # The step's all-to-alls (lowered StableHLO: XLA:CPU's compiled HLO widens bf16 collectives to f32): the
    # dispatch and the combine of bf16 rows [4, 64, D] (dropless C = 32 tokens x 2) forward and backward, and the
    # int32 local expert ids.
    mesh, ref, ep, x = layers("mxfp8", (1, 4))
    step = jax.jit(jax.grad(lambda s, x: loss(nnx.merge(nnx.graphdef(ep), s), x)[0]))
    text = step.lower(nnx.state(ep), jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))).as_text()
    out["all-to-all"] = sorted(re.findall(r'"stablehlo.all_to_all".*?: \\(tensor<([^>]*)>\\)', text))
    print("RESULT " + json.dumps(out))
    """
)


def test_expert_parallel_equals_replicated():
    """Values and gradients against MoEMLP, uneven routing, capacity drops, the all-to-alls' dtypes (docstring)."""
    (out,) = run_results(SCRIPT, 4)
    for name in ("bf16", "mxfp8", "nvfp4-fwd-mxfp8-bwd", "nvfp4-no-sr", "one expert"):
        r = out[name]
        assert r["y"] and r["dx"] and all(r["grads"].values()), (name, r)
    for name in ("bf16 2x2", "mxfp8 2x2", "nvfp4-fwd-mxfp8-bwd 2x2"):
        r = out[name]
        assert r["y"] and len(r["excess"]) == 2 and max(r["excess"].values()) <= 1, (name, r)
        if not name.startswith("nvfp4"):  # NVFP4: each replica's own amaxes, so dx is neither the whole batch's
            assert r["dx"] and len(r["other_grads"]) == 3 and all(r["other_grads"].values()), (name, r)
    assert out["capacity"]["y"] and out["capacity"]["dropped"] > 0, out["capacity"]
    assert out["all-to-all"] == ["4x64x64xbf16"] * 4 + ["4x64xi32"], out["all-to-all"]


def test_construction_errors():
    import jax
    from flax import nnx

    from jax_fp4 import recipes
    from jax_fp4.flax.moe_ep import ExpertParallelMoEMLP

    mesh = jax.make_mesh((1,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    kw = dict(recipe=recipes.BF16(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="'tensor' is not an axis"):
        ExpertParallelMoEMLP(64, 64, 4, mesh=mesh, expert_axis="tensor", **kw)
    with pytest.raises(ValueError, match="include expert_axis"):
        ExpertParallelMoEMLP(64, 64, 4, mesh=mesh, batch_axes=(), **kw)
    with pytest.raises(ValueError, match="capacity_factor"):
        ExpertParallelMoEMLP(64, 64, 4, mesh=mesh, capacity_factor=0.0, **kw)
