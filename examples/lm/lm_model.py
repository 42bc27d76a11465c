"""The decoder language models of train_lm.py, whose GEMMs follow a jax_fp4 training recipe.

Two block kinds (``ModelConfig.arch``):
  * "gpt": token embedding -> n_layers x [x + out(attn(qkv(LN(x)))), x + MLP(LN(x))] -> LN -> logits head.
    qkv: `jax_fp4.flax.nnx.LayerNormDense` (pre-norm + the fused [d, 3d] projection), out: `jax_fp4.flax.nnx.Dense`
    [d, d], MLP: `jax_fp4.flax.nnx.LayerNormMLP` (pre-norm, [d, 4d] GELU [4d, d]); these GEMMs are quantized as the
    recipe says (fprop, dgrad and wgrad).
  * "llama": `lm_layers.LlamaBlock` (RMSNorm, grouped-query attention, SwiGLU MLP, no biases) and a final RMSNorm.
  * Unquantized, bfloat16 compute: the token embedding, the attention itself (q.k^T and p.v, causal, rotary position
    embedding on q and k), the final norm and the logits head (`nnx.Linear`, untied from the embedding).
  * Mixture of experts (``moe_experts`` E > 0): every block's MLP is a `jax_fp4.flax.moe.MoEMLP` instead
    (`lm_moe.make_moe`; `jax_fp4.flax.moe_ep.ExpertParallelMoEMLP` on a mesh with an "expert" axis > 1): a pre-norm
    (gpt LayerNorm, llama RMSNorm), a bfloat16 router (unquantized) picking the top ``moe_top_k`` of E experts per
    token (Mixtral routing, dropless unless ``moe_capacity`` > 0 under expert parallelism), each expert an MLP of the
    dense MLP's kind and width (gpt: GELU [d, hidden] -> [hidden, d]; llama: SwiGLU, fine-grained experts with a
    small ``mlp_hidden``), so each token's MLP compute is top_k x one expert's, the parameters E x; its grouped GEMMs
    quantized through `jax_fp4.ragged_dot` (`expert_recipe`: the recipe, with NVFP4 1x64's fprop x in 1D NVFP4 since
    grouped quantize has no 1x64 encode). The objective adds ``moe_aux_weight`` x the Switch load-balancing loss
    (MoEMLP's E * sum_e f_e P_e, averaged over the blocks; 1 when balanced) to the cross-entropy (`loss_terms`); the
    train step also returns the blocks' mean per-expert load (`loss_terms_with_load`).
Parameters are float32 (AdamW's master weights); every layer computes in bfloat16; the loss is float32.

Block layouts: unrolled (``blocks``: an nnx.List, paths "blocks/<i>/...") or, with ``scan_layers``, stacked
([k, ...] parameters) and applied with `nnx.scan` (one compiled block per stack whatever the depth). A precision
policy with per-block rules splits the stack into contiguous segments with one recipe per layer each
(`jax_fp4.policy.block_segments`; ``stacks``: an nnx.List of scanned stacks, paths "stacks/<j>/..."), so per-block
rules keep the blocks scanned. Every layout starts from the same weights: the blocks are always initialized as
one stack of n_layers (each block its own init draws and rng streams), then split into segments or unstacked.
``remat`` checkpoints every block (`lm_layers.remat_policy`: "quantized" keeps the quantized GEMM residuals).

Randomness: `nnx.Rngs(params=seed, quantize=seed + 1)`. The parameters come from the ``params`` stream only, so every
recipe starts from the same weights for the same seed; recipes with stochastic rounding (NVFP4's gradient dy) keep a
``quantize`` stream per layer (seeded from ``rngs["quantize"]``) that draws a fresh key on every call.

Block constraints of the quantized GEMMs: d_model and the MLP width multiples of 64 and the tokens per batch
(batch x seq) a multiple of 128 (MXFP8 blocks of 32 along every GEMM axis, NVFP4 16x16 weight blocks, the RHT's 16).

Parallelism (``mesh``: a `jax.sharding.Mesh` with axes ("data", "fsdp", "tensor"), examples/lm/lm_mesh.py; None = one
device, nothing annotated):
  * data parallel: the batch is sharded over "data" and "fsdp" (`lm_mesh.batch_sharding`); XLA reduces the weight
    gradients across the batch shards.
  * fsdp: every matrix split over "fsdp" along its dimension "tensor" leaves whole (`lm_mesh.param_axes`), the AdamW
    moments alike (the optimizer state inherits the annotations); the quantized layers' recipes become
    `jax_fp4.distributed.shard_recipe(recipe, fsdp_axes="fsdp", reduce_dtype=fsdp_reduce)` (`lm_mesh.layer_recipe`:
    the weights' codes and block scales are gathered, not the weights), bf16 layers are left to XLA.
  * tensor parallel (Megatron): the qkv and MLP-up kernels [in, out] (and their biases) are split by columns over
    "tensor", the attention-output and MLP-down kernels by rows (`nnx.with_partitioning` annotations); q, k and v are
    constrained to heads split over "tensor", so attention runs per head shard and its output enters the row-split
    projection already split along its input features. The gpt block's fused qkv kernel keeps its [q | k | v] column
    order, so a column shard holds a contiguous slice of [q | k | v] rather than the q, k and v of its heads: XLA
    moves the misplaced heads between tensor shards (collective-permute / all-to-all). The llama block's kv-group
    major order avoids that (see lm_layers).
  * expert parallel ("expert" axis, MoE models): the batch split over it as well, the expert kernels split over it
    (`lm_moe.make_moe`), the rest replicated over it; no tensor parallelism with MoE (`lm_mesh.mesh_problems`).
  Norms stay replicated; the router and, without an expert axis, the experts are replicated. The jax_fp4
  primitives partition themselves (custom_partitioning): quantize runs per shard with the tensor amax reduced across
  shards, so every quantized operand equals the unsharded one.
  `make_train_step(graphdef, state, mesh)` jits the step with these in / out shardings.
"""

from __future__ import annotations

import dataclasses
import math
import typing as tp

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from lm_layers import ATTENTION, REMAT, LlamaBlock, annotate, attention, remat_policy, rope
from lm_mesh import batch_sharding, layer_recipe, state_shardings
from lm_moe import expert_recipe, make_moe, moe_call

from jax_fp4 import determinism
from jax_fp4.flax import diagnostics as fdiag
from jax_fp4.flax import nnx as fnnx
from jax_fp4.flax import policy as fpolicy
from jax_fp4.flax.moe import MoEMLP
from jax_fp4.policy import block_segments, format_table
from jax_fp4.recipes import BF16, Recipe

VOCAB = 256  # byte-level tokens
ARCHS = ("gpt", "llama")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 2
    mlp_ratio: int = 4
    seq: int = 64
    vocab: int = VOCAB
    rope_base: float = 10000.0
    scan_layers: bool = False  # stacked blocks applied with nnx.scan (one compiled block, whatever the depth)
    moe_experts: int = 0  # > 0: every block's MLP is a top-k mixture of this many experts
    moe_top_k: int = 2  # experts per token
    moe_aux_weight: float = 0.01  # weight of the load-balancing loss in the objective
    moe_capacity: float = 0.0  # expert parallelism: the dispatch capacity factor (0: dropless)
    moe_gemm: str = "xla"  # who computes the expert GEMMs: "xla" or "tokamax" (jax_fp4.ragged_dot's implementation)
    arch: str = "gpt"  # "gpt" (LayerNorm, GELU MLP, biases) or "llama" (RMSNorm, SwiGLU, GQA, no biases)
    kv_heads: int = 0  # llama: key / value heads (0: n_heads)
    mlp_hidden: int = 0  # the MLP width (0: mlp_ratio x d_model)
    remat: str = "none"  # activation checkpointing per block: lm_layers.REMAT
    attention: str = "auto"  # lm_layers.ATTENTION: "auto" / "cudnn" (cuDNN's fused kernel on a GPU) or "xla"
    # each attention call site (unrolled block, scanned segment) its own full causal window: distinct cuDNN graphs,
    # the same values (jax_fp4.determinism.distinct_causal_window); set by train_lm --deterministic --attention cudnn
    distinct_attention: bool = False

    @property
    def moe(self) -> bool:
        return self.moe_experts > 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv(self) -> int:
        return self.kv_heads or self.n_heads

    @property
    def hidden(self) -> int:
        return self.mlp_hidden or self.mlp_ratio * self.d_model

    def validate(self):
        """A list of problems (empty when the configuration suits the quantized kernels)."""
        errs = []
        if self.d_model % 64:
            errs.append(f"d_model {self.d_model} must be a multiple of 64 (the quantized GEMMs' blocks and tiles)")
        if self.n_heads < 1 or self.d_model % self.n_heads or self.head_dim % 2:
            errs.append(f"n_heads {self.n_heads} must divide d_model {self.d_model} into even head sizes")
        if self.n_layers < 1:
            errs.append(f"n_layers {self.n_layers} must be >= 1")
        if self.moe and not 1 <= self.moe_top_k <= self.moe_experts:
            errs.append(f"top-k {self.moe_top_k} must be in [1, {self.moe_experts}] (the number of experts)")
        if self.moe_aux_weight < 0 or not math.isfinite(self.moe_aux_weight):
            errs.append(f"the load-balancing loss weight {self.moe_aux_weight} must be a finite number >= 0")
        if self.arch not in ARCHS:
            errs.append(f"arch {self.arch!r} must be one of {ARCHS}")
        if self.n_heads % self.kv or (self.arch == "gpt" and self.kv != self.n_heads):
            errs.append(f"kv_heads {self.kv} must divide n_heads {self.n_heads} (and equal it for the gpt block)")
        if self.hidden % (128 if self.arch == "llama" else 64):
            errs.append(f"the MLP width {self.hidden} must be a multiple of 64 (llama: 128, whole SwiGLU chunk pairs)")
        if self.moe_capacity < 0 or not math.isfinite(self.moe_capacity):
            errs.append(f"the capacity factor {self.moe_capacity} must be a finite number >= 0 (0: dropless)")
        if self.remat not in REMAT:
            errs.append(f"remat {self.remat!r} must be one of {REMAT}")
        if self.attention not in ATTENTION:
            errs.append(f"attention {self.attention!r} must be one of {ATTENTION}")
        return errs


class Block(nnx.Module):
    """Pre-norm transformer block: x + out(attention(qkv(LN(x)))), then x + MLP(LN(x)).

    mesh: None, or a Mesh with axes ("data", "fsdp", "tensor"): qkv and MLP-up split by columns, out and MLP-down
    by rows over "tensor", q / k / v by heads, the kernels over "fsdp" (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, recipe: Recipe, rngs: nnx.Rngs, dtype=jnp.bfloat16, mesh=None):
        d = cfg.d_model
        self.cfg, self.mesh = cfg, mesh
        self.attention_site = None  # set by GPT when cfg.distinct_attention
        col = dict(kernel_init=annotate(fnnx.default_kernel_init, "col", mesh),
                   bias_init=annotate(fnnx.default_bias_init, "colvec", mesh))
        self.qkv = fnnx.LayerNormDense(d, 3 * d, recipe=recipe, dtype=dtype, rngs=rngs, **col)
        # GPT-2 style: the residual projections start smaller (std / sqrt(2 * n_layers)).
        small = nnx.initializers.variance_scaling(1.0 / (2 * cfg.n_layers), "fan_in", "truncated_normal")
        self.out = fnnx.Dense(d, d, recipe=recipe, dtype=dtype, kernel_init=annotate(small, "row", mesh),
                              rngs=rngs)
        if cfg.moe:  # replicated, or split over the "expert" mesh axis (lm_moe.make_moe)
            self.mlp = make_moe(cfg, recipe, rngs, dtype, mesh, activation="gelu", norm="layernorm",
                                hidden=cfg.hidden)
        else:
            self.mlp = fnnx.LayerNormMLP(d, cfg.mlp_ratio * d, recipe=recipe, activation="gelu", dtype=dtype,
                                         rngs=rngs, down_kernel_init=annotate(fnnx.default_kernel_init, "row", mesh),
                                         down_bias_init=fnnx.default_bias_init, **col)

    def __call__(self, x):
        """(x [B, T, d] after the block, the MoE load-balancing loss float32 (0 for a dense MLP))."""
        b, t, d = x.shape
        h, dh = self.cfg.n_heads, self.cfg.head_dim
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * h, dh), 3, axis=2)
        q, k = rope(q, self.cfg.rope_base), rope(k, self.cfg.rope_base)
        a = attention(q, k, v, self.mesh, self.cfg.attention, self.attention_site)
        x = x + self.out(a.reshape(b, t, d))
        if self.cfg.moe:
            y, aux = moe_call(self.mlp, x)
            return x + y, aux
        return x + self.mlp(x), jnp.zeros((), jnp.float32)


class GPT(nnx.Module):
    """Decoder-only language model: tokens int32 [B, T] -> logits float32 [B, T, vocab].

    segments: with ``cfg.scan_layers``, the [start, stop) block runs of the scanned stacks (default: one stack of
    all blocks); see the module docstring. Ignored for unrolled blocks."""

    def __init__(self, cfg: ModelConfig, recipe: Recipe, rngs: nnx.Rngs, dtype=jnp.bfloat16, mesh=None,
                 segments=None):
        self.cfg = cfg
        self.recipe = recipe
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=dtype, rngs=rngs,
                               embedding_init=annotate(nnx.initializers.normal(0.02), "embed", mesh))
        stack = _stack(cfg, recipe, rngs, dtype, mesh, cfg.n_layers)  # the initial weights of every layout
        if cfg.scan_layers:
            segments = tuple(tuple(seg) for seg in segments or ((0, cfg.n_layers),))
            starts, stops = [a for a, _ in segments], [b for _, b in segments]
            if starts[0] != 0 or stops[-1] != cfg.n_layers or starts[1:] != stops[:-1] or any(
                    a >= b for a, b in segments):
                raise ValueError(f"segments {segments} must be contiguous non-empty runs covering blocks "
                                 f"0..{cfg.n_layers - 1}")
            self.segments = segments
            self.stacks = nnx.List([stack if (a, b) == (0, cfg.n_layers) else _take(
                stack, slice(a, b), nnx.eval_shape(lambda n=b - a: _stack(cfg, recipe, _rngs(), dtype, mesh, n)))
                for a, b in segments])
        else:
            one = nnx.eval_shape(lambda: _block(cfg, recipe, _rngs(), dtype, mesh))
            self.blocks = nnx.List([_take(stack, i, one) for i in range(cfg.n_layers)])
        if cfg.distinct_attention:  # one site per stack (its blocks share one call) or per unrolled block
            for site, module in enumerate(self.stacks if cfg.scan_layers else self.blocks):
                module.attention_site = site
        norm = nnx.RMSNorm if cfg.arch == "llama" else nnx.LayerNorm
        self.norm = norm(cfg.d_model, epsilon=1e-6, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, dtype=dtype, rngs=rngs,
                               kernel_init=annotate(nnx.initializers.lecun_normal(), "head", mesh))

    def stacks_map(self) -> dict[str, tuple[str, ...]]:
        """{stack path: the block paths it holds} of the scanned stacks ({} for unrolled blocks): the ``stacks`` of
        `jax_fp4.flax.policy.apply`."""
        if not self.cfg.scan_layers:
            return {}
        return {f"stacks/{j}": tuple(f"blocks/{i}" for i in range(a, b)) for j, (a, b) in enumerate(self.segments)}

    def embed_tokens(self, tokens):
        """bfloat16 [B, T, d_model]: the embedding rows of tokens; for byte vocabularies (<= 256) as
        one_hot(tokens) @ embedding.

        The same values as `self.embed(tokens)` (one nonzero product per output, exact), but the embedding's
        gradient becomes a [vocab, B*T] x [B*T, d_model] GEMM instead of the scatter-add of a gather, whose atomic
        adds serialise on the few byte values text repeats (spaces, 'e', newlines): on an H100 at 32k tokens a step
        that scatter cost more than the rest of the step's kernels. Larger (BPE) vocabularies gather: a one-hot
        [B*T, vocab] would be too large, and their atomics spread over many rows.
        """
        e = self.embed
        if self.cfg.vocab > VOCAB:
            return e(tokens)
        return jax.nn.one_hot(tokens, self.cfg.vocab, dtype=e.dtype) @ e.embedding[...].astype(e.dtype)

    def __call__(self, tokens, *, return_aux_loss: bool = False, return_load: bool = False):
        """logits; with return_aux_loss also the blocks' mean MoE load-balancing loss (0 without MoE); with
        return_load also the blocks' mean per-expert load float32 [E] (the fraction of assignments per expert; [0]
        without MoE)."""
        x = self.embed_tokens(tokens)
        policy = remat_policy(self.cfg.remat)
        if self.cfg.scan_layers:
            scan = _scan_blocks if policy is None else _scan_fn(policy)
            aux = []
            for stack in self.stacks:
                x, a = scan(x, stack)
                aux.append(a)
            aux = jnp.concatenate(aux)
        else:
            call = _call if policy is None else nnx.remat(_call, policy=policy)
            aux = []
            for block in self.blocks:
                x, a = call(block, x)
                aux.append(a)
            aux = jnp.stack(aux)
        logits = self.head(self.norm(x)).astype(jnp.float32)
        loss, load = (jnp.mean(aux[:, 0]), jnp.mean(aux[:, 1:], axis=0)) if self.cfg.moe else (jnp.mean(aux),
                                                                                                  aux[:0])
        out = (logits,) + ((loss,) if return_aux_loss else ()) + ((load,) if return_load else ())
        return out if len(out) > 1 else logits


_LAYER_AXIS = {nnx.PARTITION_NAME: None}  # the stacked layer axis: unsharded (inserted into the sharding annotations)


def _rngs():
    """The rng streams of an abstract block (nnx.eval_shape): its structure matters, not its values."""
    return nnx.Rngs(params=0, quantize=0)


def _block(cfg, recipe, rngs, dtype, mesh):
    return (LlamaBlock if cfg.arch == "llama" else Block)(cfg, recipe, rngs, dtype, mesh)


def _stack(cfg, recipe, rngs, dtype, mesh, n):
    """n blocks stacked ([n, ...] parameters), each with its own init draws and rng streams."""
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=_LAYER_AXIS)
    def stacked(rngs):
        return _block(cfg, recipe, rngs, dtype, mesh)

    return stacked(rngs)


def _take(stack, index, like):
    """`like` (an abstract module of the right structure and annotations) holding stack's state at `index` (an int:
    one block; a slice: a shorter stack)."""
    graphdef, state = nnx.split(like)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda v: v[index], nnx.to_pure_dict(nnx.state(stack))))
    return nnx.merge(graphdef, state)


def _call(block, x):
    return block(x)


@nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0), transform_metadata=_LAYER_AXIS)
def _scan_blocks(x, block):
    return block(x)  # (x, aux): the load-balancing losses stacked [n_layers]


def _scan_fn(policy):
    """_scan_blocks with every block under `nnx.remat(policy=policy)`."""
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0), transform_metadata=_LAYER_AXIS)
    def scan(x, block):
        return nnx.remat(_call, policy=policy)(block, x)

    return scan


def make_model(cfg: ModelConfig, recipe: Recipe, seed: int, mesh=None, segments=None, dtype=jnp.bfloat16) -> GPT:
    """A fresh model; with a mesh its parameters are annotated (`build` places them sharded; the same values as
    without). segments: the scanned stacks' block runs (see GPT); dtype: the compute dtype (float32 in tests that
    compare layouts without bfloat16 rounding)."""
    return GPT(cfg, recipe, nnx.Rngs(params=seed, quantize=seed + 1), dtype=dtype, mesh=mesh, segments=segments)


def loss_terms(model: GPT, batch):
    """(objective, (cross-entropy, aux, per-sequence cross-entropy)) of batch uint8/int32 [B, T + 1]: the mean
    next-token cross-entropy (nats), the blocks' mean MoE load-balancing loss aux (0 without MoE), objective =
    cross-entropy + moe_aux_weight * aux; the per-sequence cross-entropy float32 [B] (each sequence's mean over its T
    tokens: the samples of the validation loss's standard error)."""
    obj, (ce, aux, seq, _) = loss_terms_with_load(model, batch)
    return obj, (ce, aux, seq)


def loss_terms_with_load(model: GPT, batch):
    """`loss_terms` with the blocks' mean per-expert load float32 [E] ([0] without MoE): (objective, (cross-entropy,
    aux, per-sequence cross-entropy, load))."""
    batch = batch.astype(jnp.int32)
    logits, aux, load = model(batch[:, :-1], return_aux_loss=True, return_load=True)
    tokens = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])
    ce = tokens.mean()
    return (ce + model.cfg.moe_aux_weight * aux if model.cfg.moe else ce), (ce, aux, tokens.mean(axis=1), load)


def loss_fn(model: GPT, batch):
    """The training objective of batch [B, T + 1]: the mean next-byte cross-entropy (+ the weighted MoE
    load-balancing loss)."""
    return loss_terms(model, batch)[0]


@dataclasses.dataclass(frozen=True)
class OptConfig:
    lr: float = 3e-3
    warmup: int = 10
    steps: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    b2: float = 0.95
    final_lr_frac: float = 0.1


def make_optimizer(o: OptConfig) -> optax.GradientTransformation:
    """AdamW (decay on matrices only) after global-norm clipping, lr: linear warmup then cosine decay."""
    warmup = min(o.warmup, max(o.steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(0.0, o.lr, warmup, max(o.steps, warmup + 1),
                                                  end_value=o.lr * o.final_lr_frac)

    def decay_mask(params):  # decay the matrices (kernels, embedding), not biases or norm scales
        return jax.tree_util.tree_map_with_path(
            lambda path, _: any(getattr(k, "key", None) in ("kernel", "embedding") for k in path), params)

    return optax.chain(optax.clip_by_global_norm(o.clip),
                       optax.adamw(schedule, b1=0.9, b2=o.b2, weight_decay=o.weight_decay, mask=decay_mask))


def make_train_step(graphdef, state=None, mesh=None, diagnostics: bool = False, deterministic: bool = False):
    """train_step(state, batch) -> (state, {"loss", "aux_loss", "seq_loss", "expert_load"}): ONE jax.jit of forward,
    backward (quantized GEMMs per the recipe, fresh stochastic-rounding keys from the layers' rng streams, whose
    counters live in `state`), clipping and the AdamW update, on the functional state (model, optimizer) of
    `nnx.split`. loss: the cross-entropy, aux_loss: the mean MoE load-balancing loss (0 without MoE), seq_loss: float32
    [B], each sequence's cross-entropy, expert_load: the blocks' mean fraction of the assignments per expert float32
    [E] ([0] without MoE), all of the parameters before the update (the gradient is that of `loss_fn`, which adds the
    weighted aux_loss); the input state's buffers are donated.

    deterministic: compile with `jax_fp4.determinism.compiler_options()` (XLA's deterministic ops; the model's
    attention "xla", or "cudnn" on one device: `ModelConfig.attention`), so two runs of the step give the same bits.

    diagnostics: the step also returns {layer path: float32 [..., 6, 6]}, the quantization statistics of every
    jax_fp4 Dense layer's six GEMM operands (`jax_fp4.flax.diagnostics.value_and_grad`; the same update).

    With a mesh, the step is jitted with in / out shardings: `state` (an example state, for its annotations) keeps
    `state_shardings`, the batch `batch_sharding`, the losses are replicated."""

    def train(state, batch):
        model, opt = nnx.merge(graphdef, state)
        if diagnostics:
            (_, (ce, aux, seq, load)), grads, stats = fdiag.value_and_grad(loss_terms_with_load, has_aux=True)(
                model, batch)
        else:
            (_, (ce, aux, seq, load)), grads = nnx.value_and_grad(loss_terms_with_load, has_aux=True)(model, batch)
        opt.update(model, grads)
        losses = {"loss": ce, "aux_loss": aux, "seq_loss": seq, "expert_load": load}
        return (nnx.state((model, opt)), losses, stats) if diagnostics else (nnx.state((model, opt)), losses)

    opts = determinism.compiler_options(deterministic) or None
    if mesh is None:
        return jax.jit(train, donate_argnums=0, compiler_options=opts)
    shardings = state_shardings(state, mesh)
    rep = NamedSharding(mesh, P())  # P(): every loss and statistic
    return jax.jit(train, in_shardings=(shardings, batch_sharding(mesh)),
                   out_shardings=(shardings, rep, rep) if diagnostics else (shardings, rep), donate_argnums=0,
                   compiler_options=opts)


def build(cfg: ModelConfig, recipe: Recipe, opt_cfg: OptConfig, seed: int, mesh=None, fsdp_reduce="float32",
          deterministic: bool = False):
    """(graphdef, state, train_step) of a fresh model and its AdamW state; with a mesh, the state is placed on it
    (see make_train_step) and the step is the sharded one (fsdp > 1: `lm_mesh.layer_recipe` for every quantized
    layer, fsdp_reduce its reduce_dtype); deterministic: see make_train_step."""
    model = make_model(cfg, recipe, seed, mesh)
    _shard_layers(model, mesh, fsdp_reduce)
    opt = nnx.Optimizer(model, make_optimizer(opt_cfg), wrt=nnx.Param)
    graphdef, state = nnx.split((model, opt))
    if mesh is not None:
        state = jax.device_put(state, state_shardings(state, mesh))
    return graphdef, state, make_train_step(graphdef, state, mesh, deterministic=deterministic)


@dataclasses.dataclass
class Phases:
    """A model trained under one policy per phase (`build_phases`): graphdefs[i] is the module definition of phase i
    (the layers' recipes), all over the same `state`; steps[i] / diag_steps[i] its compiled train steps (jitted on
    first use); tables[i] its layer -> recipe table."""

    graphdefs: list
    state: tp.Any
    steps: list
    diag_steps: list
    tables: list


def build_phases(cfg: ModelConfig, recipe: Recipe, policies, opt_cfg: OptConfig, seed: int, mesh=None,
                 fsdp_reduce: str = "float32", deterministic: bool = False) -> Phases:
    """A fresh model and AdamW state trained with `recipe`, the layers' recipes set per phase by `policies` (a
    sequence of `jax_fp4.policy.Policy`, e.g. the two phases of a `jax_fp4.schedule.PrecisionSwitch`).

    Scanned blocks are split into the segments of `segments_for` (one recipe per layer and phase in each), so
    per-block rules keep the blocks scanned. MoE blocks' MLPs take the policy's recipe for their path through
    `expert_recipe`. A phase whose recipe needs stochastic rounding where the model's does not gets rng streams
    seeded from seed + 2 (unscanned blocks; a scanned stack must be built with such a recipe). On a mesh with
    fsdp > 1 every quantized layer runs `lm_mesh.layer_recipe` of its recipe (quantized weight gathers; fsdp_reduce:
    the reduce_dtype, "float32" or "output"). deterministic: the steps are compiled with XLA's deterministic ops
    (`make_train_step`).

    Raises:
      jax_fp4.policy.UnmatchedRuleError: a rule matches no layer.
      ValueError: a scanned layer would need a new rng stream (the phases' states would differ).
    """
    model = make_model(cfg, recipe, seed, mesh, segments=segments_for(cfg, recipe, policies))
    rngs, stacks = nnx.Rngs(quantize=seed + 2), model.stacks_map()
    for pol in policies:  # first pass: every rng stream any phase needs exists in every phase
        _apply_policy(pol, model, rngs, stacks, mesh, fsdp_reduce)
    opt = nnx.Optimizer(model, make_optimizer(opt_cfg), wrt=nnx.Param)
    graphdefs, tables, state = [], [], None
    for pol in policies:
        _apply_policy(pol, model, rngs, stacks, mesh, fsdp_reduce)
        tables.append(_recipe_table(pol, model, stacks))
        graphdef, st = nnx.split((model, opt))
        if state is not None and jax.tree.structure(st) != jax.tree.structure(state):
            raise ValueError("build_phases: the phases' states differ")
        graphdefs.append(graphdef)
        state = st
    if mesh is not None:
        state = jax.device_put(state, state_shardings(state, mesh))
    return Phases(graphdefs, state, [make_train_step(g, state, mesh, deterministic=deterministic) for g in graphdefs],
                  [make_train_step(g, state, mesh, diagnostics=True, deterministic=deterministic) for g in graphdefs],
                  tables)


def block_layers(cfg: ModelConfig, recipe: Recipe) -> list[str]:
    """The paths of the quantizable layers inside one block ("qkv/dense", "out", "mlp/up", ...), from an abstract
    block (no FLOPs)."""
    one = nnx.eval_shape(lambda: _block(cfg, recipe, nnx.Rngs(params=0, quantize=0), jnp.bfloat16, None))
    return list(fpolicy.layers(one))


def segments_for(cfg: ModelConfig, recipe: Recipe, policies):
    """The scanned stacks' [start, stop) block runs for `policies` (`jax_fp4.policy.block_segments`): a boundary
    wherever some phase gives a layer of adjacent blocks different recipes; None for unrolled blocks."""
    if not cfg.scan_layers:
        return None
    return block_segments(policies, cfg.n_layers, block_layers(cfg, recipe))


def _recipe_table(policy, model, stacks) -> str:
    """The layer -> recipe table of the model as built (MoE experts: their `expert_recipe`) and the deciding rule
    (a stacked layer's: that of its first block)."""
    rows = []
    for path, node in fpolicy.layers(model).items():
        rule = policy.match(fpolicy.policy_paths(path, stacks)[0])
        blocks = stacks.get("/".join(path.split("/")[:2]))
        where = f"{path} (blocks {blocks[0].split('/')[1]}-{blocks[-1].split('/')[1]})" if blocks else path
        rows.append((where, node.recipe.name, "default" if rule is None else repr(rule.pattern)))
    return format_table(rows)


def _apply_policy(policy, model, rngs, stacks, mesh=None, fsdp_reduce="float32"):
    fpolicy.apply(policy, model, rngs=rngs, stacks=stacks)
    for _, node in nnx.iter_graph(model):  # grouped quantize has no 1x64 encode: see expert_recipe
        if isinstance(node, MoEMLP) and expert_recipe(node.recipe) != node.recipe:
            node.recipe = expert_recipe(node.recipe)
    _shard_layers(model, mesh, fsdp_reduce)


def _shard_layers(model, mesh, fsdp_reduce):
    """Every quantized layer's recipe as `lm_mesh.layer_recipe` gives it on `mesh` (unchanged without fsdp)."""
    for node in fpolicy.layers(model).values():
        node.recipe = layer_recipe(node.recipe, mesh, fsdp_reduce)


def count_params(cfg: ModelConfig, active: bool = False) -> int:
    """Parameters of the model; active: those one token uses (top_k of the experts' weights)."""
    model = nnx.eval_shape(lambda: make_model(cfg, BF16(), 0))
    n = sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if active and cfg.moe:
        per_expert = cfg.n_layers * (3 if cfg.arch == "llama" else 2) * cfg.d_model * cfg.hidden  # (gate,) up, down
        n -= (cfg.moe_experts - cfg.moe_top_k) * per_expert
    return n


def flops_per_token(cfg: ModelConfig) -> float:
    """Model FLOPs of one training token (forward + backward), the PaLM / Chinchilla count used for MFU:
    6 x (the GEMM weights one token uses: qkv, out, MLP (top_k experts with MoE), router, logits head) + the attention
    products 12 x n_layers x (n_heads x head_dim) x seq (q.k^T and p.v, forward and backward, causal mask not
    discounted). gpt: qkv 3 d^2 (+ bias), MLP 2 d h; llama: qkv d (n_heads + 2 kv_heads) head_dim, MLP 3 d h; MoE:
    the MLP times top_k, plus the router d E."""
    d, L, h = cfg.d_model, cfg.n_layers, cfg.hidden
    experts = (cfg.moe_top_k, d * cfg.moe_experts) if cfg.moe else (1, 0)
    if cfg.arch == "llama":
        block = (d * (cfg.n_heads + 2 * cfg.kv) * cfg.head_dim + cfg.n_heads * cfg.head_dim * d
                 + 3 * d * h * experts[0] + experts[1])
    else:
        block = 3 * d * d + 3 * d + d * d + 2 * d * h * experts[0] + experts[1]
    return 6.0 * (L * block + d * cfg.vocab) + 12.0 * L * cfg.n_heads * cfg.head_dim * cfg.seq
