"""Per-layer quantization diagnostics of NNX models (`jax_fp4.diagnostics` gathered inside a jitted step).

  instrument(model)      gives every `jax_fp4.flax.nnx.Dense` a zero `QuantProbe` variable float32 [..., 6, 6]
                         (leading axes of a scanned / vmapped stack); the layer then runs `jax_fp4.diagnostics.dense`,
                         which records its six operands' statistics into the probe's gradient
  uninstrument(model)    removes the probes (the model's state is again what it was)
  value_and_grad(f, ...) like `nnx.value_and_grad(f)` w.r.t. the model's `nnx.Param`s, also returning the statistics
                         {layer path: float32 [..., 6, 6]} (rows `jax_fp4.diagnostics.OPERANDS`, columns `STATS`)

Typical use: a second compiled training step, run every N steps, whose body calls `value_and_grad` instead of
`nnx.value_and_grad` and returns the statistics as an output (no host synchronisation inside the step)::

    @nnx.jit
    def diag_step(model, opt, batch):
        loss, grads, stats = diagnostics.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss, stats

The forward value, the parameter gradients and the quantization bits are those of the plain step; the extra cost is
one more quantize / dequantize of each operand and the reductions. MoE expert GEMMs (`jax_fp4.flax.moe.MoEMLP`) are
not instrumented.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_fp4.diagnostics import probe_shape
from jax_fp4.flax.nnx import Dense
from jax_fp4.flax.policy import layers
from jax_fp4.policy import path_str

__all__ = ["QuantProbe", "instrument", "uninstrument", "value_and_grad"]


def _nothing_to_instrument(model) -> ValueError:
    others = [p for p, node in layers(model, drop_in=True).items() if not isinstance(node, Dense)]
    shown = ", ".join(repr(p) for p in others[:4]) + (" ..." if len(others) > 4 else "")
    return ValueError(
        f"jax_fp4.flax.diagnostics.value_and_grad: {type(model).__name__} has no jax_fp4.flax.nnx.Dense layer, the "
        "only layer the statistics are recorded from"
        + (f"; its layers {shown} (drop-in dot_generals / einsum ops, MoE experts) are not instrumented" if others
           else "")
        + ". Build the quantized layers as jax_fp4.flax.nnx.Dense / LayerNormDense / LayerNormMLP, or record own "
        "GEMMs with jax_fp4.diagnostics.dense")


class QuantProbe(nnx.Variable):
    """A zero float32 [..., 6, 6] whose gradient carries a layer's quantization statistics (not a parameter)."""


def instrument(model) -> list[str]:
    """Set the ``quant_probe`` of every jax_fp4 `Dense` of `model` (declared by the layer, None otherwise) to a zero
    `QuantProbe`; returns their paths."""
    paths = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Dense):
            lead = node.kernel[...].shape[:-2]  # a scanned / vmapped stack: one probe per layer
            node.quant_probe = QuantProbe(jnp.zeros(lead + probe_shape(), jnp.float32))
            paths.append(path_str(path))
    return paths


def uninstrument(model) -> None:
    """Remove the probes `instrument` added."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, Dense) and node.quant_probe is not None:
            node.quant_probe = nnx.data(None)


def value_and_grad(f, *, has_aux: bool = False):
    """`nnx.value_and_grad(f, has_aux=has_aux)` (w.r.t. the first argument's `nnx.Param`s) that also returns the
    quantization statistics of its jax_fp4 Dense layers.

    Returns a function (model, *args, **kwargs) -> (value, grads, stats): value as nnx.value_and_grad's (with the aux
    when has_aux), grads the `nnx.Param` gradients (an nnx.State, as nnx.value_and_grad gives), stats {layer path:
    float32 [..., 6, 6]}. The model is instrumented for the call and restored afterwards.

    Raises:
      ValueError: the model has no `jax_fp4.flax.nnx.Dense` (alone or in LayerNormDense / LayerNormMLP), so there
      is nothing to record; the message names its drop-in layers (`make_dot_general`, `policy.apply(...,
      drop_in=True)`) and MoE layers, which are not instrumented, and the fix.
    """

    def wrapped(model, *args, **kwargs):
        paths = instrument(model)
        if not paths:  # statistics would be silently empty
            raise _nothing_to_instrument(model)
        try:
            diff = nnx.DiffState(0, nnx.Any(nnx.Param, QuantProbe))
            value, grads = nnx.value_and_grad(f, argnums=diff, has_aux=has_aux)(model, *args, **kwargs)
        finally:
            uninstrument(model)
        params, probes = nnx.split_state(grads, nnx.Param, QuantProbe)
        flat = {path_str(p): v[...] for p, v in nnx.to_flat_state(probes)}
        slot = lambda p: f"{p}/quant_probe" if p else "quant_probe"  # noqa: E731
        stats = {p: flat[slot(p)] for p in paths if slot(p) in flat}
        return value, params, stats

    return wrapped
