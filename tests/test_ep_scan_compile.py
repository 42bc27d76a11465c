"""Scanned expert-parallel MoE layers with quantized recipes compile (2 forced XLA:CPU devices, tiny sizes).

jaxlib 0.11.2 crashed compiling them (SIGSEGV in Shardy, every size, CPU and GPU): JAX's scan partial evaluation
hoisted the loop-invariant float32[0] placeholders of the jax_fp4 primitives' absent operands (unused amax, window
amax, bias) out of the scanned `jax.shard_map` into a shard_map of their own, so zero-size arrays entered the
layer's shard_map as operands, which XLA 0.11.2 replaces with constants before Shardy imports the manual
computation (`tools/dev/shardy_zero_size_repro.py`). The placeholders are now sliced from an operand of the call
(`jax_fp4._src.primitives._common.empty_operand`), and the custom VJPs' dtype residuals hold no array
(`jax_fp4._src.vjp_util.DtypeTag`, formerly zero-size arrays).

* no `shard_map` of a scanned, differentiated 2-layer stack (mxfp8 with the bf16 dispatch, nvfp4-fwd-mxfp8-bwd with
  the quantized dispatch) takes a zero-size operand (on every jax: the structure that crashed 0.11.2);
* tools/dev/ep_scan_probe.py's scanned quantized variants compile and run, each in its own process (a crash ends
  only that process; the probe records its return code).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from _cpu_devices import ROOT, run_results

pytest.importorskip("flax")

PROBE = ROOT / "tools" / "dev" / "ep_scan_probe.py"
TINY = ["--d-model", "64", "--hidden", "64", "--experts", "8", "--top-k", "2", "--tokens", "64", "--seq", "16",
        "--steps", "0"]

SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp
    from flax import nnx
    from jax.extend.core import ClosedJaxpr, Jaxpr
    from jax_fp4 import recipes
    from jax_fp4.flax.moe_ep import ExpertParallelMoEMLP

    mesh = jax.make_mesh((1, 2), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    layer_axis = {nnx.PARTITION_NAME: None}

    def zero_size_operands(jaxpr):
        found = []
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "shard_map":
                found += [str(v.aval) for v in eqn.invars if getattr(v.aval, "size", 1) == 0]
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, (ClosedJaxpr, Jaxpr)):
                        found += zero_size_operands(getattr(sub, "jaxpr", sub))
        return found

    for recipe, dispatch in (("mxfp8", False), ("nvfp4-fwd-mxfp8-bwd", True)):
        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=layer_axis)
        def stack(rngs):
            return ExpertParallelMoEMLP(64, 64, 8, mesh=mesh, expert_axis="expert", batch_axes=("data", "expert"),
                                        quantized_dispatch=dispatch, recipe=recipes.by_name(recipe), top_k=2,
                                        dtype=jnp.bfloat16, rngs=rngs)

        model = stack(nnx.Rngs(params=0, quantize=1))

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0), transform_metadata=layer_axis)
        def scanned(x, mlp):
            y, aux = mlp(x, return_aux_loss=True)
            return x + y, aux

        def loss(model, x):
            out, aux = scanned(x, model)
            return jnp.sum(jnp.square(out.astype(jnp.float32))) + jnp.sum(aux)

        graphdef, state = nnx.split(model)
        x = jnp.ones((4, 16, 64), jnp.bfloat16)
        step = jax.jit(lambda state, x: jax.grad(lambda s: loss(nnx.merge(graphdef, s), x))(state))
        closed = jax.make_jaxpr(step)(state, x)
        print("RESULT " + json.dumps({"recipe": recipe, "zero_size": zero_size_operands(closed.jaxpr)}))
    """
)


def test_no_zero_size_shard_map_operands():
    results = run_results(SCRIPT, devices=2)
    assert [r["recipe"] for r in results] == ["mxfp8", "nvfp4-fwd-mxfp8-bwd"]
    for r in results:
        assert r["zero_size"] == [], r


@pytest.mark.parametrize("variant", ["mxfp8-scan-bf16dispatch", "nvfp4-fwd-mxfp8-bwd-scan-qdispatch"])
def test_probe_scanned_quantized_variant_compiles(variant, tmp_path):
    out = tmp_path / "probe.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-P", str(PROBE), "--variants", variant, "--out", str(out),
                           "--timeout", "300", *TINY], env=env, cwd=ROOT, text=True, capture_output=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    (rec,) = json.loads(out.read_text())["variants"]
    assert rec["rc"] == 0 and rec["last_stage"] == "done", (rec["status"], rec["last_stage"], rec["stderr_tail"])
    assert rec["result"]["finite"] and rec["result"]["hlo"]["while"] > 0
