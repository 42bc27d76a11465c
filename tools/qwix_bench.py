"""Train a Llama-style NNX decoder quantized through qwix and `jax_fp4.qwix.Fp4Provider`, once per recipe, and print
the final loss, the step time and the tokens/s of each (the model is plain Flax: nnx.Einsum projections, RoPE, causal
einsum attention, SwiGLU MLP; the provider quantizes the blocks' projections and MLPs, the attention's
activation x activation einsums, the embedding and the LM head stay in BF16).

Same initial weights and the same synthetic batches for every recipe: each sequence follows t[i+1] = (5 t[i] + 3)
mod vocab from a random start, so the loss falls to near zero. Times: the median of the steps after ``--warmup``, each
synchronized with block_until_ready.

Usage (a GPU; qwix installed or on PYTHONPATH):
  python3 -P tools/qwix_bench.py --recipes bf16,nvfp4-fwd-mxfp8-bwd --out qwix_bench.json
  python3 -P tools/qwix_bench.py --tiny --steps 3 --warmup 1          # a CPU check of the script
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import optax
import qwix
from flax import nnx

from jax_fp4.qwix import Fp4Provider, Fp4Rule, set_rngs

BF16 = jnp.bfloat16


def _rope(x, positions):
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    ang = positions[:, None].astype(jnp.float32) * freq
    sin, cos = jnp.sin(ang)[None, :, None, :], jnp.cos(ang)[None, :, None, :]
    a, b = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, ffn: int, rngs: nnx.Rngs):
        h = d // heads
        kw = dict(dtype=BF16, rngs=rngs)
        self.attn_norm, self.mlp_norm = nnx.RMSNorm(d, dtype=BF16, rngs=rngs), nnx.RMSNorm(d, dtype=BF16, rngs=rngs)
        self.q = nnx.Einsum("BTD,DNH->BTNH", (d, heads, h), **kw)
        self.k = nnx.Einsum("BTD,DNH->BTNH", (d, heads, h), **kw)
        self.v = nnx.Einsum("BTD,DNH->BTNH", (d, heads, h), **kw)
        self.o = nnx.Einsum("BTNH,NHD->BTD", (heads, h, d), **kw)
        self.gate = nnx.Einsum("BTD,DF->BTF", (d, ffn), **kw)
        self.up = nnx.Einsum("BTD,DF->BTF", (d, ffn), **kw)
        self.down = nnx.Einsum("BTF,FD->BTD", (ffn, d), **kw)

    def attention(self, x):
        pos = jnp.arange(x.shape[1])
        q, k, v = _rope(self.q(x), pos), _rope(self.k(x), pos), self.v(x)
        logits = jnp.einsum("BTNH,BSNH->BNTS", q, k).astype(jnp.float32) / jnp.sqrt(q.shape[-1])
        mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        probs = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1).astype(x.dtype)
        return self.o(jnp.einsum("BNTS,BSNH->BTNH", probs, v))

    def __call__(self, x):
        x = x + self.attention(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Decoder(nnx.Module):
    def __init__(self, vocab: int, d: int, heads: int, ffn: int, layers: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d, dtype=BF16, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, ffn, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d, dtype=BF16, rngs=rngs)
        self.lm_head = nnx.Linear(d, vocab, use_bias=False, dtype=BF16, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.norm(x))


def rules(recipe: str):
    """The blocks' projections and MLPs in `recipe`; the attention einsums, embedding and LM head unquantized."""
    return [Fp4Rule(module_path=r"blocks/\d+", op_names=("einsum",), recipe="bf16"),
            Fp4Rule(module_path=r"blocks/\d+/.*", recipe=recipe)]


def batches(key, n: int, batch: int, seq: int, vocab: int):
    start = jax.random.randint(key, (n, batch, 1), 0, vocab)
    seqs = [start]
    for _ in range(seq):
        seqs.append((5 * seqs[-1] + 3) % vocab)
    toks = jnp.concatenate(seqs, axis=-1)
    return toks[..., :-1], toks[..., 1:]


def run(recipe: str, a) -> dict:
    inputs, targets = batches(jax.random.key(1), a.steps, a.batch, a.seq, a.vocab)
    model = Decoder(a.vocab, a.width, a.heads, a.ffn, a.layers, nnx.Rngs(0))
    provider = Fp4Provider(rules(recipe))
    model = qwix.quantize_model(model, provider, inputs[0], skip_nnx_init=True)
    set_rngs(model, nnx.Rngs(quantize=1))
    opt = nnx.Optimizer(model, optax.adamw(a.lr), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
        def loss_fn(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(x).astype(jnp.float32), y).mean()

        loss, g = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, g)
        return loss

    losses, times = [], []
    for i in range(a.steps):
        t0 = time.perf_counter()
        loss = step(model, opt, inputs[i], targets[i])
        loss.block_until_ready()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    step_s = statistics.median(times[a.warmup:])
    return {"recipe": recipe, "first_loss": losses[0], "final_loss": statistics.mean(losses[-min(5, a.steps):]),
            "compile_s": times[0], "step_ms": 1e3 * step_s, "tokens_per_s": a.batch * a.seq / step_s,
            "unused_rules": len(provider.get_unused_rules()), "losses": losses}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="bf16,nvfp4-fwd-mxfp8-bwd")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tiny", action="store_true", help="a CPU-sized model (2 layers, width 64, 32 tokens)")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    if a.tiny:
        a.layers, a.width, a.heads, a.ffn, a.vocab, a.seq, a.batch = 2, 64, 2, 128, 64, 32, 2
    if not 0 <= a.warmup < a.steps:
        p.error(f"--warmup {a.warmup} must be in [0, --steps {a.steps})")
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; qwix {qwix.__version__}; {a.layers} layers, "
          f"width {a.width}, {a.batch}x{a.seq} tokens")
    out = [run(r, a) for r in a.recipes.split(",")]
    print(f"{'recipe':<24} {'first loss':>10} {'final loss':>10} {'compile s':>9} {'step ms':>9} {'tokens/s':>10}")
    for r in out:
        print(f"{r['recipe']:<24} {r['first_loss']:>10.4f} {r['final_loss']:>10.4f} {r['compile_s']:>9.1f} "
              f"{r['step_ms']:>9.2f} {r['tokens_per_s']:>10.0f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "jax": jax.__version__, "device": jax.devices()[0].device_kind,
                       "results": out}, f, indent=1)
    return out


if __name__ == "__main__":
    main()
