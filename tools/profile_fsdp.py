"""FSDP step of an MLP stack: step time and collective bytes per recipe and distributed option, as JSON.

Each layer is d_model -> d_ff -> d_model (`jax_fp4.dense`, GELU between, bfloat16 compute, float32 parameters
sharded P("fsdp", None) and P(None, "fsdp"), tokens sharded over "fsdp"), with an SGD update in the step. Variants:
  plain        the recipe as is (XLA gathers the weights before quantizing; float32 wgrad reductions)
  fsdp         shard_recipe(recipe, fsdp_axes="fsdp"): codes and block scales gathered
  fsdp+output  also reduce_dtype="output": weight gradients reduce-scattered in bfloat16
Collectives are read from the HLO right after SPMD partitioning (an XLA dump; the dtypes the program asks for,
before a backend widens them), the all-reduce count from the compiled HLO. peak_bytes_in_use is the process's peak
so far (device 0): for a per-variant figure run one variant a process (--runs recipe:variant).

    python tools/profile_fsdp.py --out $OUT/profile_fsdp.json            # every local device on the "fsdp" axis
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
        python tools/profile_fsdp.py --d-model 128 --d-ff 256 --layers 2 --tokens 512 --steps 2   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile
import time

DUMP = tempfile.mkdtemp(prefix="profile_fsdp_")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_dump_to={DUMP} --xla_dump_hlo_pass_re=spmd-partitioning").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_fp4  # noqa: E402
from jax_fp4 import distributed, recipes  # noqa: E402

BITS = {"f4e2m1fn": 4, "f8e4m3fn": 8, "f8e5m2": 8, "f8e8m0fnu": 8, "u8": 8, "s8": 8, "pred": 8, "bf16": 16,
        "f16": 16, "f32": 32, "s32": 32, "u32": 32}
OPS = "all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter"


def collectives(text):
    """{op: {"count", "bytes", "by_dtype"}}: bytes of the whole tensor each collective gathers or reduces."""
    out = {}
    for line in text.splitlines():
        m = re.search(rf"= (.*?) ({OPS})(?:-start)?\(", line)
        if not m:
            continue
        k = 1
        if m[2] == "reduce-scatter":
            g = re.search(r"replica_groups=\{\{([\d,]+)\}", line) or re.search(r"replica_groups=\[[\d,]*?(\d+)\]", line)
            k = (len(g[1].split(",")) if "{" in g[0] else int(g[1])) if g else 1
        e = out.setdefault(m[2], {"count": 0, "bytes": 0, "by_dtype": {}})
        e["count"] += 1
        for d, dims in re.findall(r"(\w+)\[([\d,]*)\]", m[1]):
            b = BITS.get(d, 0) * k * int(np.prod([int(x) for x in dims.split(",") if x] or [1])) // 8
            e["bytes"] += b
            e["by_dtype"][d] = e["by_dtype"].get(d, 0) + b
    return out


def make_recipe(name, variant):
    r = recipes.by_name(name)
    if variant == "plain" or not r.quantized:
        return r
    return distributed.shard_recipe(r, fsdp_axes="fsdp", reduce_dtype="output" if variant == "fsdp+output"
                                    else "float32")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--d-ff", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16384, help="global tokens per step")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (after 2 warm-up steps)")
    ap.add_argument("--runs", default="bf16:plain,nvfp4-fwd-mxfp8-bwd:plain,nvfp4-fwd-mxfp8-bwd:fsdp,"
                    "nvfp4-fwd-mxfp8-bwd:fsdp+output,nvfp4:fsdp+output", help="recipe:variant,...")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "profile_fsdp.json"))
    a = ap.parse_args(argv)

    devs = jax.devices()
    mesh = Mesh(np.array(devs), ("fsdp",))
    rng = np.random.default_rng(0)
    shapes = [s for _ in range(a.layers) for s in ((a.d_model, a.d_ff), (a.d_ff, a.d_model))]
    specs = [P("fsdp", None), P(None, "fsdp")] * a.layers
    params = [jax.device_put(jnp.asarray(rng.standard_normal(s) * s[0] ** -0.5, jnp.float32), NamedSharding(mesh, p))
              for s, p in zip(shapes, specs, strict=True)]
    xs = NamedSharding(mesh, P("fsdp", None))
    x = jax.device_put(jnp.asarray(rng.standard_normal((a.tokens, a.d_model)), jnp.bfloat16), xs)
    report = {"devices": [str(d) for d in devs], "device_kind": devs[0].device_kind, "jax": jax.__version__,
              "d_model": a.d_model, "d_ff": a.d_ff, "layers": a.layers, "tokens": a.tokens,
              "weight_elements": int(sum(np.prod(s) for s in shapes)), "runs": []}

    for run in a.runs.split(","):
        name, variant = run.split(":")
        recipe = make_recipe(name, variant)

        def loss(ps, x, recipe=recipe):
            h = x
            for i, w in enumerate(ps):
                h = jax_fp4.dense(h, w.astype(jnp.bfloat16), recipe=recipe, key=jax.random.key(i))
                h = jax.nn.gelu(h) if i % 2 == 0 else h + x
            return jnp.mean(jnp.square(h.astype(jnp.float32)))

        def step(ps, x):
            val, g = jax.value_and_grad(loss)(ps, x)
            return [p - 1e-3 * gi for p, gi in zip(ps, g, strict=True)], val

        ps_sh = [NamedSharding(mesh, p) for p in specs]
        f = jax.jit(step, in_shardings=(ps_sh, xs), out_shardings=(ps_sh, NamedSharding(mesh, P())),
                    donate_argnums=(0,))
        before = set(glob.glob(os.path.join(DUMP, "*after_spmd-partitioning*")))
        t0 = time.perf_counter()
        compiled = f.lower(params, x).compile()
        compile_s = time.perf_counter() - t0
        new = sorted(set(glob.glob(os.path.join(DUMP, "*after_spmd-partitioning*"))) - before)
        partitioned = collectives(open(new[-1]).read()) if new else {}
        final = collectives(compiled.as_text())
        ps = params
        for _ in range(2):
            ps, val = compiled(ps, x)
        jax.block_until_ready(ps)
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            ps, val = compiled(ps, x)
            jax.block_until_ready(ps)
            times.append(time.perf_counter() - t0)
        params = ps
        mem = getattr(devs[0], "memory_stats", lambda: None)() or {}
        entry = {"recipe": name, "variant": variant, "compile_s": compile_s,
                 "step_ms_median": 1e3 * float(np.median(times)), "step_ms_min": 1e3 * float(np.min(times)),
                 "tokens_per_s": a.tokens / float(np.median(times)), "loss": float(val),
                 "collectives_partitioned": partitioned,
                 "all_reduces_compiled": final.get("all-reduce", {}).get("count", 0),
                 "peak_bytes_in_use": mem.get("peak_bytes_in_use")}
        report["runs"].append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k != "collectives_partitioned"}), flush=True)
        print("   ", {op: (c["count"], c["by_dtype"]) for op, c in partitioned.items()}, flush=True)

    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(report, fh, indent=1)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
