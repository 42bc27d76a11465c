"""Pure-JAX reproducer: jaxlib 0.11.2 crashes (SIGSEGV) compiling a `jax.shard_map` that uses a zero-size operand.

XLA's zero_sized_hlo_elimination pass (before Shardy's shardy-xla pass) replaces the zero-size operand of the
shard_map's manual computation with a constant, and Shardy's canonicalization then crashes in
`ManualComputationUnusedInputsPattern::matchAndRewrite` (gdb backtrace). CPU and GPU alike; jax/jaxlib 0.10.2 and
0.12.0.1 compile the same programs. With GSPMD (JAX_USE_SHARDY_PARTITIONER=false) programs with ragged_dot abort
instead ("RaggedDot is only supported with Shardy").

How jax_fp4 met it: JAX's scan partial evaluation hoists loop-invariant values of a scanned shard_map body (here the
float32[0] placeholders of absent primitive operands) into a shard_map of their own and passes them into the body's
shard_map, so scanned expert-parallel MoE layers with a quantized recipe crashed (tools/dev/ep_scan_probe.py). The
"scan" case below is that structure. jax_fp4 now derives those placeholders from an operand
(`jax_fp4._src.primitives._common.empty_operand`).

Each case runs in its own process (a crash ends it) and prints "ok" or the signal:
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 python3 tools/dev/shardy_zero_size_repro.py
jaxlib 0.11.2: "used" and "scan" -11 (SIGSEGV), "unused" ok; 0.10.2 / 0.12.0.1: all ok.
"""

from __future__ import annotations

import subprocess
import sys

CASES = ("unused", "used", "scan")


def build(case: str):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    empty = jnp.zeros((0,), jnp.float32)
    if case == "unused":  # the zero-size operand is dropped at trace time: compiles
        def f(x):
            return jax.shard_map(lambda x, z: x * 2, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))(x, empty)
    elif case == "used":
        def f(x):
            return jax.shard_map(lambda x, z: x * 2 + jnp.sum(z), mesh=mesh, in_specs=(P("x"), P()),
                                 out_specs=P("x"))(x, empty)
    else:  # "scan": a loop-invariant zero-size value made in a scanned, differentiated shard_map body
        def layer(x, w):
            def body(x, w):
                z = jnp.zeros((0,), jnp.float32)  # loop invariant: hoisted out of the scan by its partial eval
                return jnp.tanh(x * w) + jnp.sum(z * w)  # z * w varies per iteration: z enters the loop
            return jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))(x, w)

        def f(x):
            ws = jnp.arange(1.0, 3.0)
            return jax.grad(lambda x: jnp.sum(jax.lax.scan(lambda c, w: (layer(c, w), None), x, ws)[0]))(x)
    x = jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(mesh, P("x")))
    return jax.jit(f).lower(x)


def main() -> int:
    if len(sys.argv) > 1:
        build(sys.argv[1]).compile()
        print("ok")
        return 0
    import jax

    print(f"jax {jax.__version__}")
    for case in CASES:
        proc = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True)
        print(f"{case:8s} {'ok' if proc.returncode == 0 else f'rc {proc.returncode}'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
