"""jax_fp4's recipes for qwix-quantized Flax models (needs qwix: ``pip install jax_fp4[qwix]``).

qwix (github.com/google/qwix) intercepts ``jax.lax.dot_general``, ``jax.numpy.einsum`` and ``jax.lax.ragged_dot``
calls inside a Flax NNX or Linen model and hands each to a *provider* chosen by regex rules over module paths
(``qwix.quantize_model(model, provider, ...)``). `Fp4Provider` is such a provider: every intercepted call that an
`Fp4Rule` matches runs through jax_fp4's quantized `dot_general` / einsum / `ragged_dot` with the rule's recipe
(fprop, dgrad and wgrad as the `jax_fp4.recipes.Recipe` says); every other call runs unchanged::

    from jax_fp4.qwix import Fp4Provider, Fp4Rule
    provider = Fp4Provider([Fp4Rule(module_path=r".*attn.*", recipe="bf16"),
                            Fp4Rule(module_path=".*", recipe="nvfp4-fwd-mxfp8-bwd")])
    model = qwix.quantize_model(model, provider, x)             # NNX (Linen: quantize_model(model, provider))
    set_rngs(model, nnx.Rngs(quantize=0))                        # NNX stochastic-rounding keys (NVFP4)

Importing ``jax_fp4`` never imports qwix; importing ``jax_fp4.qwix`` does.
"""

from __future__ import annotations

try:
    import qwix as _qwix  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in a subprocess by tests/test_qwix.py
    raise ImportError("jax_fp4.qwix needs qwix, which is not installed: pip install jax_fp4[qwix]") from e

from jax_fp4.qwix.provider import Fp4Provider, Fp4Rule, UnquantizedOpWarning, set_rngs

__all__ = ["Fp4Provider", "Fp4Rule", "UnquantizedOpWarning", "TESTED_QWIX_VERSIONS", "set_rngs"]

#: The qwix releases the tests run against (the provider uses qwix's `QuantizationProvider` interface and its
#: current-module helpers, which are not part of qwix's stable API).
TESTED_QWIX_VERSIONS = ("0.1.8",)
