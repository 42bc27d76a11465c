"""examples/lm/lm_collectives.py: the collectives of a compiled step per module and per step (loop bodies weighted by
their known trip counts)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from _cpu_devices import run_results

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "lm"))
lm_collectives = pytest.importorskip("lm_collectives")

# A hand-written module: ENTRY runs one all-reduce and a 16-trip loop whose body all-gathers, calls a computation
# that reduce-scatters, and runs a nested 3-trip loop with an asynchronous all-reduce (counted by its -done op) and
# a loop of unknown trip count with a collective-permute.
HLO = textwrap.dedent('''
    HloModule m, entry_computation_layout={()->f32[]}

    %add (a: f32[], b: f32[]) -> f32[] {
      %a = f32[] parameter(0)
      %b = f32[] parameter(1)
      ROOT %s = f32[] add(%a, %b)
    }

    %inner_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
      %p = (s32[], f32[8]{0}) parameter(0)
      %x = f32[8]{0} get-tuple-element(%p), index=1
      %ars = f32[8]{0} all-reduce-start(%x), replica_groups={{0,1}}, to_apply=%add
      %ard = f32[8]{0} all-reduce-done(%ars)
      ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ard)
    }

    %cond (p: (s32[], f32[8])) -> pred[] {
      %p = (s32[], f32[8]{0}) parameter(0)
      ROOT %c = pred[] constant(true)
    }

    %scatter (x: bf16[4,8]) -> bf16[2,8] {
      %x = bf16[4,8]{1,0} parameter(0)
      ROOT %rs = bf16[2,8]{1,0} reduce-scatter(%x), replica_groups={{0,1}}, dimensions={0}, to_apply=%add
    }

    %unknown_body (p: (s32[], u8[16])) -> (s32[], u8[16]) {
      %p = (s32[], u8[16]{0}) parameter(0)
      %y = u8[16]{0} get-tuple-element(%p), index=1
      %cp = u8[16]{0} collective-permute(%y), source_target_pairs={{0,1},{1,0}}
      ROOT %t = (s32[], u8[16]{0}) tuple(%i, %cp)
    }

    %outer_body (p: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
      %p = (s32[], bf16[4,8]{1,0}) parameter(0)
      %w = bf16[4,8]{1,0} get-tuple-element(%p), index=1
      %ag = bf16[8,8]{1,0} all-gather(%w), replica_groups={{0,1}}, dimensions={0}
      %c = bf16[2,8]{1,0} call(%w), to_apply=%scatter
      %in = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%inner_body, @TRIP3@
      %other = (s32[], u8[16]{0}) while(%t1), condition=%cond, body=%unknown_body
      ROOT %t = (s32[], bf16[4,8]{1,0}) tuple(%i, %w)
    }

    ENTRY %main () -> f32[] {
      %z = f32[] constant(0)
      %ar = f32[] all-reduce(%z), replica_groups={{0,1}}, to_apply=%add
      %l = (s32[], bf16[4,8]{1,0}) while(%i), condition=%cond, body=%outer_body, @TRIP16@
      ROOT %r = f32[] copy(%ar)
    }
    ''').replace("@TRIP3@", 'backend_config={"known_trip_count":{"n":"3"}}').replace(
    "@TRIP16@", 'backend_config={"known_trip_count":{"n":"16"},"other":1}')


def test_loop_bodies_count_per_trip():
    got = lm_collectives.collective_bytes(HLO)
    assert got["all-reduce"] == {"count": 2, "bytes": 4 + 32, "count_per_step": 1 + 16 * 3,
                                 "bytes_per_step": 4 + 16 * 3 * 32}
    assert got["all-gather"] == {"count": 1, "bytes": 128, "count_per_step": 16, "bytes_per_step": 16 * 128}
    assert got["reduce-scatter"] == {"count": 1, "bytes": 32, "count_per_step": 16, "bytes_per_step": 16 * 32}
    # the loop without a known trip count runs its body once per enclosing iteration, and is reported
    assert got["collective-permute"] == {"count": 1, "bytes": 16, "count_per_step": 16, "bytes_per_step": 16 * 16}
    assert got["loops_without_trip_count"] == 1


def test_long_tuples_count_every_element():
    """XLA prints /*index=N*/ before every fifth element of a long tuple; a combined all-gather of six arrays counts
    all six (the comment's "=" must not end the shape)."""
    def tup(rows):  # five u8[rows, 8] and one u8[rows, 4], as XLA prints a six-element tuple
        return "(" + ", ".join([f"u8[{rows},8]{{1,0}}"] * 5) + f", /*index=5*/u8[{rows},4]{{1,0}})"

    hlo = "\n".join([
        "ENTRY %main () -> u8[] {",
        f"  %s = ({tup(2)}, {tup(4)}) all-gather-start(%a, %b, %c, %d, %e, /*index=5*/%f), dimensions={{0}}",
        f"  %g = {tup(4)} all-gather-done(%s)",
        "  ROOT %r = u8[] constant(0)",
        "}",
    ])
    got = lm_collectives.collective_bytes(hlo)
    assert got["all-gather"] == {"count": 1, "bytes": 5 * 32 + 16, "count_per_step": 1, "bytes_per_step": 5 * 32 + 16}


SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    sys.path.insert(0, sys.argv[1])
    import lm_collectives

    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))

    def step(ws, x):  # a scanned stack: each block's matmul sums its sharded contraction across the devices
        def block(h, w):  # h [8, 64] replicated, w [32, 64] this device's rows
            part = jax.lax.dynamic_slice_in_dim(h, jax.lax.axis_index("d") * 32, 32, axis=1)
            return jnp.tanh(jax.lax.psum(part @ w, "d")), None
        return jax.lax.scan(block, x, ws)[0]

    out = {}
    for layers in (2, 5):
        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(None, "d", None), P()), out_specs=P()))
        ws = jnp.ones((layers, 64, 64), jnp.float32)
        x = jnp.ones((8, 64), jnp.float32)
        out[layers] = lm_collectives.collective_bytes(f.lower(ws, x).compile().as_text())
    print("RESULT " + json.dumps(out))
    """
)


@pytest.mark.slow  # a multi-device subprocess
def test_scanned_stack_counts_each_block():
    """A scan of 2 and of 5 blocks on 2 CPU devices: the module holds one all-reduce for every stack size, the
    per-step count is one per block (8 x 64 float32 each)."""
    (res,) = run_results(SCRIPT, 2, args=(ROOT / "examples" / "lm",), timeout=300)
    for layers, got in res.items():
        ar = got["all-reduce"]
        assert ar["count"] == 1 and ar["bytes"] == 8 * 64 * 4, got
        assert ar["count_per_step"] == int(layers) and ar["bytes_per_step"] == int(layers) * 8 * 64 * 4, got
        assert "loops_without_trip_count" not in got
