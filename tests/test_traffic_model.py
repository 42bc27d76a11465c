"""benchmarks/traffic.py: the traffic floor of a Dense step, worked by hand for 64 x 64 x 64 bf16 operands."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import traffic  # noqa: E402

from jax_fp4 import recipes  # noqa: E402

E = 64 * 64  # elements of x, w and dY
MX = E + E // 32  # an MXFP8 residual: E4M3 codes + one E8M0 scale per 32


def test_mxfp8_floor_by_hand():
    fprop = 2 * (2 * E + 2 * E + MX)  # x and w: read, exact operand written, residual written
    dgrad = (2 * E + 2 * 2 * E) + (MX + 2 * E)  # dY: read, two exact operands; w residual dequantized
    wgrad = MX + 2 * E  # x residual dequantized
    assert traffic.floor_bytes(recipes.MXFP8(), 64, 64, 64) == {"fprop": fprop, "dgrad": dgrad, "wgrad": wgrad,
                                                                  "total": fprop + dgrad + wgrad}


def test_nvfp4_forward_adds_the_weight_amax_read():
    mx = traffic.floor_bytes(recipes.MXFP8(), 64, 64, 64)
    nv = traffic.floor_bytes(recipes.by_name("nvfp4-fwd-mxfp8-bwd"), 64, 64, 64)
    assert nv["fprop"] - mx["fprop"] == 2 * E  # w's tensor amax: one read of w (x's comes from its producer)
    assert (nv["dgrad"], nv["wgrad"]) == (mx["dgrad"], mx["wgrad"])
    assert traffic.floor_bytes(recipes.by_name("bf16"), 64, 64, 64)["total"] == 0
