"""examples/quantize_your_model.py on the CPU: the policy reaches the model's own nnx.Linear layers through the
drop-in dot_general (quantized GEMMs in the hidden layers, bf16 in the output layer), training lowers the loss, and
the statistics table lists every quantized layer's forward operands."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import quantize_your_model as example  # noqa: E402
from flax import nnx  # noqa: E402

from jax_fp4 import recipes  # noqa: E402
from jax_fp4.flax import policy as flax_policy  # noqa: E402


def test_the_policy_reaches_the_plain_layers():
    sizes = (64, 128, 64)
    model = example.MLP(sizes, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (64, 64), jnp.float32)
    plain = model(x)
    got = flax_policy.apply(example.make_policy(len(sizes) - 1), model, drop_in=True)
    assert got == {"layers/0": recipes.NVFP4Fwd_MXFP8Bwd(), "layers/1": recipes.BF16()}
    quantized = model(x)
    # the hidden layer's GEMM now runs on NVFP4 operands: close to the float result, not equal to it
    assert not bool(jnp.array_equal(quantized, plain))
    rel = float(jnp.linalg.norm(quantized - plain) / jnp.linalg.norm(plain))
    assert rel < 0.3, rel  # two NVFP4 operands of about 20 dB SNR each (the table below): ~0.1 relative error each


def test_example_trains_and_prints_the_table(capsys):
    before, after = example.main(steps=10, sizes=(64, 64, 64), batch_size=64)
    assert math.isfinite(before) and math.isfinite(after)
    assert after < before  # the held-out loss falls with quantized GEMMs (deterministic: fixed keys, no SR)
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("layers/") and "fprop_" in line]
    assert [(r[0], r[2]) for r in rows] == [("layers/0", "fprop_x"), ("layers/0", "fprop_w")]
    for r in rows:
        snr = float(r[3])
        assert 10.0 < snr < 40.0, r  # NVFP4 of Gaussian-like operands: about 20 dB
