"""`jax_fp4.flax.moe_ep.ExpertParallelMoEMLP` on 4 forced CPU devices against the replicated `MoEMLP`.

* expert mesh (4), bf16 dispatch: the output y, the input gradient dx and every parameter gradient equal MoEMLP's
  on the whole batch bit for bit (the expert kernels' bf16 gradients compared in bf16: XLA may fold MoEMLP's final
  cast into its dot), for bf16, mxfp8, nvfp4-fwd-mxfp8-bwd and nvfp4-no-sr (every group holds the unsharded group's
  rows, in order, with the same padding; docs/numerics.md "Expert parallelism");
* nvfp4 (stochastic rounding in the backward), quantized dispatch: y equals MoEMLP's, the gradients are finite;
* data x expert mesh (2 x 2): each data replica's experts see that replica's tokens, so y equals MoEMLP applied to
  each replica's half of the batch (bit for bit; NVFP4 included: the tensor amaxes are the replica's), an expert
  kernel's gradient is the sum of the two halves' gradients a + b within the roundings to the compute dtype bfloat16
  (2 u (|a| + |b|) (1 + u), u = 2^-8: each half and the sum rounded once, or kept in float32 where XLA folds the
  casts; docs/numerics.md section 9); bf16 / mxfp8: dx and the router and norm gradients equal the whole batch's
  bit for bit;
* quantized dispatch (the default for mxfp8, nvfp4-fwd-mxfp8-bwd, nvfp4-no-sr): y, dx and the router and norm
  gradients equal MoEMLP's bit for bit; the expert kernels' gradients (wgrad from the dequantized dispatched x^ and
  dy^) differ from the bf16 dispatch's by less than the recipe's own gradients differ from the bf16 recipe's;
* uneven routing (quantized dispatch): a router with one nonzero column (expert 5; the other logits tied at 0)
  sends every token to expert 0 and each to expert 1 or 5 (about half each, by the sign of its normalized sum),
  experts 2-4, 6 and 7 get none and devices 1 and 3 receive nothing, dropless: y, dx and the router and norm
  gradients as MoEMLP's, the expert gradients finite;
* capacity_factor: the buffers shrink and the assignments past the capacity are dropped (their terms leave y);
* the step's all-to-alls (dtypes and shapes from the lowered HLO): bf16 rows for the bf16 dispatch; uint8 codes and
  scales for the quantized dispatch's x and dy (0.40 of the bf16 dispatch's bytes there), bf16 for y and dx;
* construction / trace-time errors.
"""

from __future__ import annotations

import textwrap

import numpy as np
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

    out, bf16_grads = {}, None
    for name in ("bf16", "mxfp8", "nvfp4-fwd-mxfp8-bwd", "nvfp4-no-sr"):  # expert axis 4: the unsharded bits
        mesh, ref, ep, x = layers(name, (1, 4), quantized_dispatch=False)
        xs = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
        y0, dx0, g0 = run(ref, x)
        y1, dx1, g1 = run(ep, xs)
        out[name] = dict(y=same(y0, y1), dx=same(dx0, dx1), grads=same_grads(g0, g1))
        if name == "bf16":
            bf16_grads = g0
            continue
        _, _, epq, _ = layers(name, (1, 4))  # quantized dispatch (the default for these recipes)
        y2, dx2, g2 = run(epq, xs)
        rel = lambda a, b, k: float(np.linalg.norm(a[k] - b[k]) / np.linalg.norm(b[k]))  # noqa: E731
        out[name + " quantized"] = dict(
            default=bool(epq.dispatches_quantized()), y=same(y0, y2), dx=same(dx0, dx2),
            grads={k: same(g0[k], g2[k]) for k in g0 if "up" not in k and "down" not in k},
            # the expert kernels' gradients: the dispatch's change against the recipe's own change from bf16
            expert_rel={k: (rel(g2, g1, k), rel(g1, bf16_grads, k)) for k in g0 if "up" in k or "down" in k})

    # nvfp4 (stochastic rounding of dy): the forward rounds to nearest, so y is MoEMLP's; the backward's random bits
    # differ (per device and dispatch group), the gradients are finite.
    mesh, ref, ep, x = layers("nvfp4", (1, 4))
    y0, _, _ = run(ref, x)
    y1, dx1, g1 = run(ep, jax.device_put(x, NamedSharding(mesh, P(("data", "expert")))))
    out["nvfp4 sr"] = dict(y=same(y0, y1), finite=bool(np.all(np.isfinite(dx1)))
                           and all(bool(np.all(np.isfinite(v))) for v in g1.values()))

    for name in ("bf16", "mxfp8", "nvfp4-fwd-mxfp8-bwd"):  # data x expert: per data replica
        mesh, ref, ep, x = layers(name, (2, 2), **({} if name.startswith("nvfp4") else dict(quantized_dispatch=False)))
        y0, dx0, g0 = run(ref, x)
        halves = [run(ref, x[:4]), run(ref, x[4:])]
        y1, dx1, g1 = run(ep, jax.device_put(x, NamedSharding(mesh, P(("data", "expert")))))
        experts = [k for k in g0 if "up" in k or "down" in k]
        excess = {}  # |g - (a + b)| over its bound 2 u (|a| + |b|) (1 + u), u = 2^-8 (max over the kernel: <= 1)
        for k in experts:
            a, b = (h[2][k].astype(np.float64) for h in halves)
            bound = 2 * 2.0**-8 * (abs(a) + abs(b)) * (1 + 2.0**-8)
            excess[k] = float(np.max(np.abs(g1[k] - (a + b)) / np.maximum(bound, 1e-30)))
        out[name + " 2x2"] = dict(y=same(np.concatenate([h[0] for h in halves]), y1), dx=same(dx0, dx1),
                                  excess=excess, other_grads={k: same(g0[k], g1[k]) for k in g0 if k not in experts})

    # Uneven routing (quantized dispatch): logits 0 but for expert 5's (the sum of the normalized token), so every
    # token goes to expert 0 (ties: the lowest index) and to expert 5 or 1: experts 2-4, 6, 7 and devices 1, 3 idle.
    # (Checked below: the counts of the routed experts.)
    mesh, ref, ep, x = layers("nvfp4-fwd-mxfp8-bwd", (1, 4))
    for m in (ref, ep):
        m.router.kernel[...] = jnp.zeros((D, E)).at[:, 5].set(1.0)
    x = jnp.abs(x) + 0.1
    y0, dx0, g0 = run(ref, x)
    y1, dx1, g1 = run(ep, jax.device_put(x, NamedSharding(mesh, P(("data", "expert")))))
    e = np.asarray(nnx.jit(lambda m, x: m.route(m.norm(x).reshape(-1, D))[2])(ref, x))
    out["one expert counts"] = np.bincount(e.reshape(-1), minlength=E).tolist()
    out["one expert"] = dict(y=same(y0, y1), dx=same(dx0, dx1), grads={
        k: same(g0[k], g1[k]) if "up" not in k and "down" not in k else bool(np.all(np.isfinite(g1[k]))) for k in g0})

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

    # The step's all-to-alls (lowered StableHLO: XLA:CPU's compiled HLO widens bf16 collectives to f32), dropless
    # C = 32 tokens x 2 = 64 rows per destination: bf16 dispatch: x and dy to the experts, y and dx back, bf16
    # [4, 64, D], and the int32 local expert ids; nvfp4-fwd-mxfp8-bwd's quantized dispatch: x as NVFP4 codes
    # (two per byte, [4, 64, D/2]) and E4M3 scales [4, 64, D/16], dy as MXFP8 codes [4, 64, D] and E8M0 scales
    # [4, 64, D/32], all uint8.
    for name, kw in (("bf16", dict(quantized_dispatch=False)), ("quantized", {})):
        mesh, ref, ep, x = layers("nvfp4-fwd-mxfp8-bwd", (1, 4), **kw)
        step = jax.jit(jax.grad(lambda s, x: loss(nnx.merge(nnx.graphdef(ep), s), x)[0]))
        text = step.lower(nnx.state(ep), jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))).as_text()
        out["all-to-all " + name] = sorted(re.findall(r'"stablehlo.all_to_all".*?: \\(tensor<([^>]*)>\\)', text))
    print("RESULT " + json.dumps(out))
    """
)


def test_expert_parallel_equals_replicated():
    """Values and gradients against MoEMLP, uneven routing, capacity drops, the all-to-alls' dtypes (docstring)."""
    (out,) = run_results(SCRIPT, 4)
    for name in ("bf16", "mxfp8", "nvfp4-fwd-mxfp8-bwd", "nvfp4-no-sr", "one expert"):
        r = out[name]
        assert r["y"] and r["dx"] and all(r["grads"].values()), (name, r)
    for name in ("mxfp8", "nvfp4-fwd-mxfp8-bwd", "nvfp4-no-sr"):
        r = out[name + " quantized"]
        assert r["default"] and r["y"] and r["dx"] and len(r["grads"]) == 3 and all(r["grads"].values()), (name, r)
        assert len(r["expert_rel"]) == 2 and all(d <= own for d, own in r["expert_rel"].values()), (name, r)
    assert out["nvfp4 sr"] == dict(y=True, finite=True), out["nvfp4 sr"]
    counts = out["one expert counts"]
    assert counts[0] == 128 and counts[1] + counts[5] == 128 and counts[1] > 0 and counts[5] > 0, counts
    assert counts[2:5] == [0, 0, 0] and counts[6:] == [0, 0], counts
    for name in ("bf16 2x2", "mxfp8 2x2", "nvfp4-fwd-mxfp8-bwd 2x2"):
        r = out[name]
        assert r["y"], (name, r)
        if not name.startswith("nvfp4"):  # (nvfp4: each replica's own amaxes and the quantized dispatch's x^ wgrad)
            assert len(r["excess"]) == 2 and max(r["excess"].values()) <= 1, (name, r)
            assert r["dx"] and len(r["other_grads"]) == 3 and all(r["other_grads"].values()), (name, r)
    assert out["capacity"]["y"] and out["capacity"]["dropped"] > 0, out["capacity"]
    assert out["all-to-all bf16"] == ["4x64x64xbf16"] * 4 + ["4x64xi32"], out["all-to-all bf16"]
    q = ["4x64x2xui8", "4x64x32xui8", "4x64x4xui8", "4x64x64xbf16", "4x64x64xbf16", "4x64x64xui8", "4x64xi32"]
    assert out["all-to-all quantized"] == q, out["all-to-all quantized"]
    bytes_ = {kind: sum(np.prod([int(d) for d in s.split("x")[:-1]]) * (2 if s.endswith("bf16") else 1)
                        for s in out["all-to-all " + kind] if not s.endswith("i32")) for kind in ("bf16", "quantized")}
    # x and dy: (D/2 + D/16 + D + D/32) / (2 D + 2 D) = 0.398 of the bf16 dispatch's bytes; dx and y stay bf16
    assert bytes_["quantized"] == 4 * 64 * (32 + 4 + 64 + 2 + 2 * 128), bytes_


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
    with pytest.raises(ValueError, match="quantized_dispatch=True needs"):
        ExpertParallelMoEMLP(64, 64, 4, mesh=mesh, quantized_dispatch=True, **kw)
    layer = ExpertParallelMoEMLP(64, 64, 4, mesh=mesh, recipe=recipes.MXFP8(), rngs=nnx.Rngs(0))
    assert layer.dispatches_quantized() and not ExpertParallelMoEMLP(64, 64, 4, mesh=mesh, **kw).dispatches_quantized()
    layer.recipe = recipes.BF16()  # as a policy may: the dispatch follows the recipe
    assert not layer.dispatches_quantized()
