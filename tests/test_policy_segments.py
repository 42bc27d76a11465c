"""jax_fp4.policy.block_segments and jax_fp4.flax.policy's ``stacks`` (scanned stacks resolved as their blocks).

* block_segments: the contiguous runs of blocks with one recipe per layer, for first / last-N rules, fractions,
  sublayer rules, MLP-only, exclusions that do not tell blocks apart, and the union of a switch's phases;
* policy_paths / assignments / apply / describe with ``stacks``: a stack's layers get their blocks' recipe, rules
  are checked against the block paths, a stack whose blocks disagree raises ValueError naming the layer.
Nothing here traces a quantized GEMM.
"""

from __future__ import annotations

import pytest

pytest.importorskip("flax")

from flax import nnx  # noqa: E402

from jax_fp4 import policy as P  # noqa: E402
from jax_fp4 import recipes  # noqa: E402
from jax_fp4.flax import nnx as fnnx  # noqa: E402
from jax_fp4.flax import policy as FP  # noqa: E402
from jax_fp4.schedule import PrecisionSwitch  # noqa: E402

NV, MX, BF = recipes.NVFP4Fwd_MXFP8Bwd(), recipes.MXFP8(), recipes.BF16()
SUBS = ["qkv", "out", "mlp/up", "mlp/down"]


@pytest.mark.parametrize("policy,expected", [
    (P.uniform(NV), ((0, 24),)),
    (P.last_blocks(4, num_blocks=24).with_default(NV), ((0, 20), (20, 24))),
    (P.first_blocks(1) + P.last_blocks(2, num_blocks=24), ((0, 1), (1, 22), (22, 24))),
    (P.last_fraction(0.1, num_blocks=24).with_default(NV), ((0, 21), (21, 24))),  # ceil(2.4) = 3 blocks
    (P.first_blocks(2, MX) + P.last_blocks(2, num_blocks=24), ((0, 2), (2, 22), (22, 24))),
    (P.Policy((P.Rule("blocks/3/mlp", BF),), NV), ((0, 3), (3, 4), (4, 24))),  # a sublayer rule splits too
    (P.exclude("*/out") + P.mlp_only(), ((0, 24),)),  # the same in every block: no split
    (P.exclude("blocks/0") + P.exclude("blocks/1"), ((0, 2), (2, 24))),  # equal neighbours merge
], ids=["uniform", "last4", "first1-last2", "last-fraction", "mxfp8-first-bf16-last", "sublayer", "mlp-only",
        "merge"])
def test_block_segments(policy, expected):
    assert P.block_segments(policy, 24, SUBS) == expected


def test_block_segments_of_switch_phases():
    """A boundary of either phase is a boundary (both phases run on the same state, hence the same stacks)."""
    pol = P.last_blocks(2, num_blocks=8).with_default(NV)
    phases = PrecisionSwitch(0.9, MX, "all").phases(P.first_blocks(1, MX) + pol)
    assert P.block_segments(phases, 8, SUBS) == ((0, 1), (1, 6), (6, 8))
    assert P.block_segments([P.uniform(NV), P.last_blocks(3, num_blocks=8)], 8, SUBS) == ((0, 5), (5, 8))
    assert P.block_segments(P.uniform(NV), 1, []) == ((0, 1),)
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        P.block_segments(P.uniform(NV), 0, SUBS)


class _Net(nnx.Module):
    """Two scanned-style stacks (vmapped Dense layers) standing for blocks 0-2 and 3."""

    def __init__(self):
        def stack(n):
            @nnx.split_rngs(splits=n)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return fnnx.Dense(64, 64, recipe=NV, rngs=rngs)

            return make(nnx.Rngs(0))

        self.stacks = nnx.List([stack(3), stack(1)])


STACKS = {"stacks/0": ("blocks/0", "blocks/1", "blocks/2"), "stacks/1": ("blocks/3",)}


def test_apply_with_stacks():
    net = _Net()
    assert FP.policy_paths("stacks/0", STACKS) == ["blocks/0", "blocks/1", "blocks/2"]
    assert FP.policy_paths("stacks/1/x", STACKS) == ["blocks/3/x"] and FP.policy_paths("head", STACKS) == ["head"]
    pol = P.last_blocks(1, num_blocks=4).with_default(MX)
    out = FP.apply(pol, net, stacks=STACKS)
    assert out == {"stacks/0": MX, "stacks/1": BF}
    assert net.stacks[0].recipe == MX and net.stacks[1].recipe == BF
    table = FP.describe(pol, net, stacks=STACKS)
    assert "'blocks/3'" in table and "default" in table
    with pytest.raises(ValueError, match="the stacked layer 'stacks/0' holds blocks/0, blocks/1, blocks/2"):
        FP.apply(P.last_blocks(2, num_blocks=4), net, stacks=STACKS)  # block 2 is bf16, blocks 0-1 are not
    with pytest.raises(P.UnmatchedRuleError, match="'blocks/7'"):
        FP.apply(P.exclude("blocks/7"), net, stacks=STACKS)
    with pytest.raises(P.UnmatchedRuleError):  # without stacks the block rules match nothing
        FP.apply(pol, net)
