"""Models written as Flax's and qwix's examples write them, quantized through jax_fp4.qwix and trained a few steps on
the CPU with each recipe: a Linen encoder-decoder Transformer (nn.MultiHeadDotProductAttention), an NNX Llama-style
decoder block (nnx.Einsum projections, RoPE, SwiGLU) and an NNX MoE block calling jax.lax.ragged_dot. Each run must
stay finite, lower its loss and use every rule, and its model's forward must hold jax_fp4's quantize primitives
exactly when the recipe quantizes (the intercepted GEMMs were routed through jax_fp4)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax")
qwix = pytest.importorskip("qwix")
optax = pytest.importorskip("optax")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _qwix_models import NnxMoE  # noqa: E402
from flax import nnx  # noqa: E402

from jax_fp4.qwix import Fp4Provider, Fp4Rule, set_rngs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:The 'm.iter_modules:DeprecationWarning")  # qwix 0.1.8 calls it

RECIPES = ["bf16", "mxfp8", "nvfp4-fwd-mxfp8-bwd", "nvfp4"]
VOCAB, D, HEADS, LEN, STEPS = 64, 64, 2, 16, 4  # head width 32: whole MXFP8 blocks per head


def _tokens(seed, batch=2):
    return jax.random.randint(jax.random.key(seed), (batch, LEN), 0, VOCAB)


def _xent(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


# ---- Linen encoder-decoder Transformer ------------------------------------------------------------------------------
class MlpBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(2 * D, name="wi")(x))
        return nn.Dense(D, name="wo")(h)


class EncoderLayer(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x + nn.MultiHeadDotProductAttention(HEADS, name="attention")(nn.LayerNorm()(x))
        return x + MlpBlock(name="mlp")(nn.LayerNorm()(x))


class DecoderLayer(nn.Module):
    @nn.compact
    def __call__(self, y, enc):
        causal = nn.make_causal_mask(jnp.ones(y.shape[:2]))
        y = y + nn.MultiHeadDotProductAttention(HEADS, name="self_attention")(nn.LayerNorm()(y), mask=causal)
        y = y + nn.MultiHeadDotProductAttention(HEADS, name="cross_attention")(nn.LayerNorm()(y), enc)
        return y + MlpBlock(name="mlp")(nn.LayerNorm()(y))


class Seq2Seq(nn.Module):
    @nn.compact
    def __call__(self, src, tgt_in):
        embed = nn.Embed(VOCAB, D, name="shared_embedding")
        enc = embed(src)
        for i in range(2):
            enc = EncoderLayer(name=f"encoder_{i}")(enc)
        y = embed(tgt_in)
        for i in range(2):
            y = DecoderLayer(name=f"decoder_{i}")(y, nn.LayerNorm()(enc))
        return nn.Dense(VOCAB, name="logits")(nn.LayerNorm()(y))


def _train_linen(recipe):
    # The attention's activation x activation einsums stay in BF16; every projection takes the recipe.
    provider = Fp4Provider([Fp4Rule(module_path=r".*attention", op_names=("einsum",), recipe="bf16"),
                            Fp4Rule(recipe=recipe)])
    model = qwix.quantize_model(Seq2Seq(), provider)
    src, tgt = _tokens(1), _tokens(2)
    tgt_in = jnp.pad(tgt[:, :-1], ((0, 0), (1, 0)))
    params = model.init(jax.random.key(0), src, tgt_in)["params"]
    opt = optax.adam(3e-3)
    state = opt.init(params)

    @jax.jit
    def step(params, state, key):
        loss, g = jax.value_and_grad(lambda p: _xent(model.apply({"params": p}, src, tgt_in,
                                                                  rngs={"quantize": key}), tgt))(params)
        upd, state = opt.update(g, state)
        return loss, optax.apply_updates(params, upd), state

    losses = []
    for k in jax.random.split(jax.random.key(3), STEPS):
        loss, params, state = step(params, state, k)
        losses.append(float(loss))
    jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, src, tgt_in, rngs={"quantize": k}))(params)
    return losses, provider, str(jaxpr)


# ---- NNX Llama-style decoder ----------------------------------------------------------------------------------------
def _rope(x, positions):
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    ang = positions[:, None].astype(jnp.float32) * freq
    sin, cos = jnp.sin(ang)[None, :, None, :], jnp.cos(ang)[None, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, rngs):
        h = D // HEADS
        self.q = nnx.Einsum("BTD,DNH->BTNH", (D, HEADS, h), rngs=rngs)
        self.k = nnx.Einsum("BTD,DNH->BTNH", (D, HEADS, h), rngs=rngs)
        self.v = nnx.Einsum("BTD,DNH->BTNH", (D, HEADS, h), rngs=rngs)
        self.o = nnx.Einsum("BTNH,NHD->BTD", (HEADS, h, D), rngs=rngs)

    def __call__(self, x):
        pos = jnp.arange(x.shape[1])
        q, k, v = _rope(self.q(x), pos), _rope(self.k(x), pos), self.v(x)
        logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        probs = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
        return self.o(jnp.einsum("BNTS,BSNH->BTNH", probs, v))


class LlamaBlock(nnx.Module):
    def __init__(self, rngs):
        self.attn_norm, self.mlp_norm = nnx.RMSNorm(D, rngs=rngs), nnx.RMSNorm(D, rngs=rngs)
        self.attn = Attention(rngs)
        self.gate = nnx.Einsum("BTD,DF->BTF", (D, 2 * D), rngs=rngs)
        self.up = nnx.Einsum("BTD,DF->BTF", (D, 2 * D), rngs=rngs)
        self.down = nnx.Einsum("BTF,FD->BTD", (2 * D, D), rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Llama(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([LlamaBlock(rngs) for _ in range(2)])
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.lm_head = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.norm(x))


def _train_nnx(model, provider, batch, loss_fn):
    qm = qwix.quantize_model(model, provider, batch[0], skip_nnx_init=True)
    set_rngs(qm, nnx.Rngs(quantize=5))
    opt = nnx.Optimizer(qm, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(m, opt, inputs, targets):
        loss, g = nnx.value_and_grad(lambda m: loss_fn(m(inputs), targets))(m)
        opt.update(m, g)
        return loss

    losses = [float(step(qm, opt, *batch)) for _ in range(STEPS)]
    graphdef, state = nnx.split(qm)
    jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(batch[0]))(state)
    return losses, provider, str(jaxpr)


def _train_llama(recipe):
    provider = Fp4Provider([Fp4Rule(module_path=r"blocks/\d+/attn", op_names=("einsum",), recipe="bf16"),
                            Fp4Rule(recipe=recipe)])
    tokens = _tokens(4)
    batch = (tokens[:, :-1], tokens[:, 1:])
    batch = (jnp.pad(batch[0], ((0, 0), (0, 1))), jnp.pad(batch[1], ((0, 0), (0, 1))))  # T = LEN
    return _train_nnx(Llama(nnx.Rngs(0)), provider, batch, _xent)


class MoEModel(nnx.Module):
    def __init__(self, rngs):
        self.moe = NnxMoE(D, D, 4, 2, rngs)
        self.head = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        return self.head(x + self.moe(x))


def _train_moe(recipe):
    provider = Fp4Provider([Fp4Rule(module_path="moe/router", recipe="bf16"), Fp4Rule(recipe=recipe)])
    x = jax.random.normal(jax.random.key(6), (64, D), jnp.float32)
    y = jnp.tanh(x @ jax.random.normal(jax.random.key(7), (D, D), jnp.float32) / np.sqrt(D))
    return _train_nnx(MoEModel(nnx.Rngs(params=0, quantize=1)), provider, (x, y),
                      lambda out, t: jnp.mean(jnp.square(out - t)))


TRAINERS = {"linen_seq2seq": _train_linen, "nnx_llama": _train_llama, "nnx_moe": _train_moe}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("model", list(TRAINERS))
def test_trains(model, recipe):
    losses, provider, jaxpr = TRAINERS[model](recipe)
    assert np.isfinite(losses).all(), losses
    assert losses[-1] < losses[0], losses
    assert provider.get_unused_rules() == []
    quantize = "jf4_grouped_quantize" if model == "nnx_moe" else "jf4_quantize"  # (the MoE's dense head too)
    assert (quantize in jaxpr) == (recipe != "bf16"), f"{recipe}: {quantize} in the forward: {quantize in jaxpr}"


def test_qwix_bench_tool_runs(tmp_path):
    """tools/qwix_bench.py (the GPU measurement of the provider) on its CPU-sized model: finite losses, every rule
    used, the JSON written."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import qwix_bench

    out = tmp_path / "bench.json"
    (res,) = qwix_bench.main(["--tiny", "--steps", "2", "--warmup", "1", "--recipes", "mxfp8", "--out", str(out)])
    assert res["recipe"] == "mxfp8" and res["unused_rules"] == 0 and np.isfinite(res["losses"]).all()
    assert json.loads(out.read_text())["results"][0]["step_ms"] == res["step_ms"]
