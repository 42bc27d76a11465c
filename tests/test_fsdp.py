"""FSDP and cross-shard reductions of `jax_fp4.dense` (`jax_fp4.distributed`) on 4 forced CPU devices.

XLA_FLAGS must be set before the backend starts, so the checks run in one subprocess (as tests/test_sharding_train.py)
that prints RESULT lines. Collective dtypes and bytes are read from the HLO right after SPMD partitioning (an XLA
dump, `--xla_dump_hlo_pass_re=spmd-partitioning`): XLA:CPU later widens 8-bit, 4-bit and bfloat16 collectives to the
types it implements, which says nothing of what a GPU moves. The count of all-reduces is read from the compiled HLO.

* FSDP (kernels sharded P("fsdp", None) or P(None, "fsdp") over 4 devices, or P("fsdp", "tensor") /
  P("tensor", "fsdp") on a 2 x 2 fsdp x tensor mesh; tokens over "fsdp"), a 2-layer MLP step with
  `shard_recipe(..., fsdp_axes="fsdp")`: every gradient equals the unsharded step's bit for bit (the codes are the
  unsharded quantize's; the float32 wgrad sums of exact products are order-free), the float32 mean loss within its
  reordering bound 2 (n - 1) 2^-24 loss; no all-gather moves a float wider than 8 bits of a weight's size (the
  bfloat16 / float32 weight is never gathered); the weight all-gather bytes are <= 0.85x (nvfp4-fwd-mxfp8-bwd) /
  0.6x (nvfp4) of gathering the bfloat16 weights (2 bytes an element) once per use, fprop and dgrad: NVFP4 codes
  0.5 B + E4M3 scales 1/16 B an element, MXFP8 codes 1 B + E8M0 scales 1/32 B.
* reduce_dtype="output": one dense layer, loss = sum(y * t), so dY = t exactly; under data parallelism (4 x "data",
  kernel replicated) the weight gradient is all-reduced in bfloat16, under FSDP reduce-scattered in bfloat16: the
  bytes of 2 an element, half of float32's. The result differs from the unsharded one by the roundings of the n = 4
  partial sums: |dw - dw_1| <= (n + 1) u (|x|^T |t|) (1 + 2^-4)^2 + u |dw_1| elementwise, u = 2^-8 (bfloat16's unit
  roundoff): each partial rounded once, n - 1 additions and the final cast, each <= u times the sum of the partials'
  magnitudes, which the quantized operands' magnitudes bound (MXFP8 E4M3 rounds normal values within 2^-4
  relative; a subnormal code adds at most 2^-10 of its block's scale, which the slack of the n + 1 term covers).
  reduce_dtype="float32" (the default) keeps float32 all-reduces and bit equality. The bfloat16 step (recipe BF16)
  reduces its weight gradient in bfloat16 too.
* Data parallelism, a 2-layer MLP: the number of all-reduces in the compiled step (the scalars of one quantize in
  one collective).
"""

from __future__ import annotations

import textwrap

import pytest
from _cpu_devices import run_results

pytestmark = pytest.mark.slow  # multi-device subprocesses: full suite only


SCRIPT = textwrap.dedent(
    """
    import glob, json, os, re, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_fp4
    from jax_fp4 import distributed, recipes

    DUMP = sys.argv[1]
    BITS = {"f4e2m1fn": 4, "f8e4m3fn": 8, "f8e5m2": 8, "f8e8m0fnu": 8, "u8": 8, "s8": 8, "pred": 8, "bf16": 16,
            "f16": 16, "f32": 32, "s32": 32, "u32": 32}
    OPS = "all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter"

    def group_size(line):
        m = re.search(r"replica_groups=\\{\\{([\\d,]+)\\}", line)
        if m:
            return len(m[1].split(","))
        m = re.search(r"replica_groups=\\[[\\d,]*?(\\d+)\\]", line)
        return int(m[1]) if m else 1

    def collectives(text):
        # [{op, dtypes, bytes, elements}] of every collective; bytes and elements of the whole tensor it gathers or
        # reduces (all-gather / all-reduce: the result; reduce-scatter: the result times the group size)
        out = []
        for line in text.splitlines():
            m = re.search(rf"= (.*?) ({OPS})(?:-start)?\\(", line)
            if not m:
                continue
            res = re.findall(r"(\\w+)\\[([\\d,]*)\\]", m[1])
            k = group_size(line) if m[2] == "reduce-scatter" else 1
            n = lambda dims: k * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
            out.append({"op": m[2], "dtypes": sorted({d for d, _ in res}),
                        "bytes": sum(BITS[d] * n(s) / 8 for d, s in res), "elements": sum(n(s) for _, s in res)})
        return out

    def partitioned(fn, *args):
        # (collectives after SPMD partitioning, all-reduce count of the compiled HLO, compiled)
        before = set(glob.glob(os.path.join(DUMP, "*after_spmd-partitioning*")))
        compiled = fn.lower(*args).compile()
        new = sorted(set(glob.glob(os.path.join(DUMP, "*after_spmd-partitioning*"))) - before)
        text = open(new[-1]).read()
        final = collectives(compiled.as_text())
        return collectives(text), sum(c["op"] == "all-reduce" for c in final), compiled

    rng = np.random.default_rng(0)
    D, H, B = 128, 256, 256

    def mlp_loss(recipe):
        def loss(ws, x):
            h = jax_fp4.dense(x, ws[0].astype(jnp.bfloat16), recipe=recipe, key=jax.random.key(1))
            h = jax_fp4.dense(jax.nn.relu(h), ws[1].astype(jnp.bfloat16), recipe=recipe, key=jax.random.key(2))
            return jnp.mean(h.astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss)

    ws = [jnp.asarray(rng.standard_normal(s) * 0.08, jnp.float32) for s in ((D, H), (H, D))]
    x = jnp.asarray(rng.standard_normal((B, D)), jnp.bfloat16)
    UNSHARDED = {}
    CASES = {"rows": ((4,), [P("fsdp", None)] * 2), "columns": ((4,), [P(None, "fsdp")] * 2),
             "fsdp x tensor": ((2, 2), [P("fsdp", "tensor"), P("tensor", "fsdp")])}
    for rname, layout, red in (("nvfp4-fwd-mxfp8-bwd", "rows", "float32"), ("nvfp4", "columns", "float32"),
                               ("nvfp4-fwd-mxfp8-bwd", "fsdp x tensor", "float32"),
                               ("nvfp4", "fsdp x tensor", "float32"),
                               ("nvfp4-fwd-mxfp8-bwd", "fsdp x tensor", "output")):
        shape, wspecs = CASES[layout]
        mesh = Mesh(np.array(jax.devices()[:4]).reshape(shape), ("fsdp", "tensor")[:len(shape)])
        r = distributed.shard_recipe(recipes.by_name(rname), fsdp_axes="fsdp", reduce_dtype=red)
        sw = [NamedSharding(mesh, s) for s in wspecs]
        f = jax.jit(mlp_loss(r), in_shardings=(sw, NamedSharding(mesh, P("fsdp", None))),
                    out_shardings=(NamedSharding(mesh, P()), sw))
        found, n_ar, compiled = partitioned(f, ws, x)
        if rname not in UNSHARDED:
            UNSHARDED[rname] = jax.jit(mlp_loss(recipes.by_name(rname)))(ws, x)
        l1, g1 = UNSHARDED[rname]
        l2, g2 = compiled(ws, x)
        print("RESULT", json.dumps({"case": "fsdp", "recipe": rname, "layout": layout, "reduce_dtype": red,
                                    "collectives": found,
                                    "weight_elements": [int(w.size) for w in ws],
                                    "loss_1": float(l1), "loss_sharded": float(l2), "n": B * D,
                                    "grads_equal": [bool(np.array_equal(a, b)) for a, b in zip(g1, g2)]}),
              flush=True)

    # data parallelism: the all-reduces of the step (scalars of each quantize combined into one)
    dmesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    rep = NamedSharding(dmesh, P())
    for rname in ("bf16", "nvfp4-fwd-mxfp8-bwd", "nvfp4"):
        f = jax.jit(mlp_loss(recipes.by_name(rname)), in_shardings=([rep, rep], NamedSharding(dmesh, P("data", None))),
                    out_shardings=(rep, [rep, rep]))
        found, n_ar, _ = partitioned(f, ws, x)
        print("RESULT", json.dumps({"case": "dp all-reduces", "recipe": rname, "all_reduces": n_ar}), flush=True)

    # reduce_dtype: one layer, loss = sum(y * t) so dY = t
    K, N, M = 256, 128, 512
    w = jnp.asarray(rng.standard_normal((K, N)) * 0.05, jnp.bfloat16)
    xs = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    t = jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16)
    base = recipes.NVFP4Fwd_MXFP8Bwd()

    def one(recipe):
        return jax.grad(lambda w, x: jnp.sum(jax_fp4.dense(x, w, recipe=recipe).astype(jnp.float32)
                                             * t.astype(jnp.float32)))

    g_ref = np.asarray(jax.jit(one(base))(w, xs), np.float64)
    mag = np.abs(np.asarray(xs, np.float64)).T @ np.abs(np.asarray(t, np.float64))
    for case, axes, wspec in (("dp", ("data",), P()), ("fsdp", ("fsdp",), P("fsdp", None))):
        m = Mesh(np.array(jax.devices()[:4]), axes)
        for red in ("float32", "output", "bf16 step"):
            r = (recipes.BF16() if red == "bf16 step" else
                 distributed.shard_recipe(base, fsdp_axes=axes if case == "fsdp" else (), reduce_dtype=red))
            sw = NamedSharding(m, wspec)
            f = jax.jit(one(r), in_shardings=(sw, NamedSharding(m, P(axes[0], None))), out_shardings=sw)
            found, n_ar, compiled = partitioned(f, w, xs)
            g = np.asarray(compiled(w, xs), np.float64)
            print("RESULT", json.dumps({"case": "reduce " + case, "reduce_dtype": red, "collectives": found,
                                        "grad_elements": int(w.size), "equal": bool(np.array_equal(g, g_ref)),
                                        "excess": float(np.max(np.abs(g - g_ref)
                                                               - 5 * 2.0**-8 * mag * (1 + 2.0**-4) ** 2
                                                               - 2.0**-8 * np.abs(g_ref)))}), flush=True)
    """
)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    dump = tmp_path_factory.mktemp("hlo")
    return run_results(SCRIPT, 4, args=(dump,), dump=dump, timeout=900)


# weight all-gather bytes / gathering the bfloat16 weights, per recipe (the targets)
TARGET = {"nvfp4-fwd-mxfp8-bwd": 0.85, "nvfp4": 0.6}


def test_fsdp_gathers_codes_and_equals_unsharded(results):
    fsdp = [r for r in results if r["case"] == "fsdp" and r["reduce_dtype"] == "float32"]
    assert {(r["recipe"], r["layout"]) for r in fsdp} == {("nvfp4-fwd-mxfp8-bwd", "rows"), ("nvfp4", "columns"),
                                                          ("nvfp4-fwd-mxfp8-bwd", "fsdp x tensor"),
                                                          ("nvfp4", "fsdp x tensor")}
    for r in fsdp:
        where = (r["recipe"], r["layout"])
        assert all(r["grads_equal"]), (where, r["grads_equal"])
        # the loss: a float32 mean of n squares, summed in another order per shard: <= 2 (n - 1) 2^-24 loss apart
        assert abs(r["loss_sharded"] - r["loss_1"]) <= 2 * (r["n"] - 1) * 2.0**-24 * r["loss_1"], where
        gathers = [c for c in r["collectives"] if c["op"] == "all-gather"]
        smallest_weight = min(r["weight_elements"])
        wide = [c for c in gathers if c["elements"] >= smallest_weight // 4 and set(c["dtypes"]) - {"u8"}]
        assert not wide, (where, "a weight gathered wider than 8 bits", wide)
        assert not [c for c in r["collectives"] if c["op"] in ("all-to-all", "collective-permute")], where
        # the first layer's dgrad is not taken (x is not differentiated): fprop of both layers, dgrad of the second;
        # on the fsdp x tensor mesh each gather assembles a tensor-parallel half
        bf16_bytes = 2 * (sum(r["weight_elements"]) + r["weight_elements"][1]) / (2 if "tensor" in r["layout"] else 1)
        got = sum(c["bytes"] for c in gathers if c["dtypes"] == ["u8"])
        assert got <= TARGET[r["recipe"]] * bf16_bytes, (where, got, bf16_bytes)
        assert got > 0.25 * bf16_bytes, (where, got)  # the codes do cross the wire


def test_fsdp_tensor_parallel_reductions_in_bfloat16(results):
    """fsdp x tensor mesh with reduce_dtype="output": every reduction of a GEMM product (the row-parallel fprop and
    column-parallel dgrad over "tensor", the weight gradients over "fsdp") runs in bfloat16; only float32 scalars
    (the loss, tensor amaxes) stay float32. Numerics: the bound of the one-layer test below."""
    (r,) = [r for r in results if r["case"] == "fsdp" and r["reduce_dtype"] == "output"]
    sums = [c for c in r["collectives"] if c["op"] in ("all-reduce", "reduce-scatter") and c["elements"] > 1]
    assert sums and all(c["dtypes"] == ["bf16"] for c in sums), sums
    ops = {c["op"] for c in sums}
    assert ops == {"all-reduce", "reduce-scatter"}, sums  # over tensor (activations); over fsdp (weight gradients)


def test_reduce_dtype_output_halves_wgrad_bytes(results):
    red = {(r["case"], r["reduce_dtype"]): r for r in results if r["case"].startswith("reduce")}
    assert set(red) == {(c, d) for c in ("reduce dp", "reduce fsdp") for d in ("float32", "output", "bf16 step")}
    for case in ("reduce dp", "reduce fsdp"):  # the bfloat16 step's weight-gradient reduction: bfloat16, 2 B
        bf16 = [c for c in red[case, "bf16 step"]["collectives"] if c["op"] in ("all-reduce", "reduce-scatter")
                and c["elements"] >= red[case, "bf16 step"]["grad_elements"]]
        assert bf16 and all(c["dtypes"] == ["bf16"] for c in bf16), (case, bf16)
        del red[case, "bf16 step"]
    for (case, dtype), r in red.items():
        sums = [c for c in r["collectives"] if c["op"] in ("all-reduce", "reduce-scatter")
                and c["elements"] >= r["grad_elements"]]
        assert sums, (case, dtype, r["collectives"])
        want = "bf16" if dtype == "output" else "f32"
        assert all(c["dtypes"] == [want] for c in sums), (case, dtype, sums)
        assert sum(c["bytes"] for c in sums) == (2 if dtype == "output" else 4) * r["grad_elements"], (case, sums)
        if case == "reduce fsdp" and dtype == "output":
            assert [c["op"] for c in sums] == ["reduce-scatter"], sums
        if dtype == "float32":
            assert r["equal"], (case, "float32 sums of exact products must equal the unsharded gradient")
        assert r["excess"] <= 0, (case, dtype, r["excess"])


def test_dp_scalar_all_reduces_combined(results):
    """A 2-layer MLP step under data parallelism: bfloat16 has 1 all-reduce (the gradients and the loss, combined);
    each NVFP4 quantize of a sharded activation adds one (its tensor amax, RHT amax and NaN flag combined): the x of
    each layer (nvfp4-fwd-mxfp8-bwd), and dY as well (nvfp4). Separately they were 2 and 4 per layer."""
    got = {r["recipe"]: r["all_reduces"] for r in results if r["case"] == "dp all-reduces"}
    layers = 2
    assert got == {"bf16": 1, "nvfp4-fwd-mxfp8-bwd": 1 + layers, "nvfp4": 1 + 2 * layers}, got


def test_one_device_unchanged():
    """On one device the distributed options change nothing: dense (forward and gradients) and a batched
    dot_general (vmapped dense) give the plain recipe's bits."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_fp4
    from jax_fp4 import distributed, recipes

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 64, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2, 128, 64)) * 0.1, jnp.bfloat16)
    for base in (recipes.NVFP4(),):  # tensor scales, RHT and SR operands through both GEMM paths
        r = distributed.shard_recipe(base, fsdp_axes=("fsdp",), reduce_dtype="output")
        assert isinstance(r, distributed.ShardedRecipe) and r.name == base.name
        outs = []
        for rr in (base, r):
            def f(x, w, rr=rr):
                y = jax_fp4.dense(x[0], w[0], recipe=rr, key=jax.random.key(0))
                z = jax_fp4.dot_general(x, w, (((2,), (1,)), ((0,), (0,))), recipe=rr, key=jax.random.key(1))
                return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(z.astype(jnp.float32) ** 2)
            outs.append(jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w))
        for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_shard_recipe_errors():
    from jax_fp4 import distributed, recipes

    with pytest.raises(ValueError, match="reduce_dtype must be one of"):
        distributed.shard_recipe(recipes.MXFP8(), reduce_dtype="bfloat16")
    with pytest.raises(TypeError, match="fsdp_axes must be a tuple of mesh axis names"):
        distributed.shard_recipe(recipes.MXFP8(), fsdp_axes=(0,))
    with pytest.raises(ValueError, match="unknown recipe"):
        distributed.shard_recipe("nvfp5", fsdp_axes="fsdp")
