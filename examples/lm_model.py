"""A GPT-style decoder whose attention and MLP GEMMs follow a jax_fp4 training recipe (used by train_lm.py).

Model: token embedding -> n_layers x [x + out(attn(qkv(LN(x)))), x + MLP(LN(x))] -> LN -> logits head.
  * qkv: `jax_fp4.flax.nnx.LayerNormDense` (pre-norm + the fused [d, 3d] projection), out: `jax_fp4.flax.nnx.Dense`
    [d, d], MLP: `jax_fp4.flax.nnx.LayerNormMLP` (pre-norm, [d, 4d] GELU [4d, d]); these GEMMs are quantized as the
    recipe says (fprop, dgrad and wgrad).
  * Unquantized, bfloat16 compute: the token embedding, the attention itself (q.k^T and p.v, causal, rotary position
    embedding on q and k), the final LayerNorm and the logits head (`nnx.Linear`).
  * Mixture of experts (``moe_experts`` E > 0): every block's MLP is a `jax_fp4.flax.moe.MoEMLP` instead: pre-norm
    LayerNorm, a bfloat16 router (unquantized) picking the top ``moe_top_k`` of E experts per token (Mixtral routing,
    dropless), each expert a GELU MLP [d, mlp_ratio*d] -> [mlp_ratio*d, d] like the dense MLP (so each token's
    compute is top_k x the dense MLP's, the parameters E x), its grouped GEMMs quantized through
    `jax_fp4.ragged_dot` (`expert_recipe`: the recipe, with NVFP4 1x64's fprop x in 1D NVFP4 since grouped quantize
    has no 1x64 encode). The objective adds ``moe_aux_weight`` x the Switch load-balancing loss (MoEMLP's
    E * sum_e f_e P_e, averaged over the blocks; 1 when balanced) to the cross-entropy (`loss_terms`).
Parameters are float32 (AdamW's master weights); every layer computes in bfloat16; the loss is float32. The blocks
are unrolled, or with ``scan_layers`` stacked ([n_layers, ...] parameters) and applied with `nnx.scan`: one compiled
block whatever the depth (XLA compile time of 4 blocks ~2.5x lower; unrolled runs faster on the CPU).

Randomness: `nnx.Rngs(params=seed, quantize=seed + 1)`. The parameters come from the ``params`` stream only, so every
recipe starts from the same weights for the same seed; recipes with stochastic rounding (NVFP4's gradient dy) keep a
``quantize`` stream per layer (seeded from ``rngs["quantize"]``) that draws a fresh key on every call.

Block constraints of the quantized GEMMs: d_model and the MLP width multiples of 64 and the tokens per batch
(batch x seq) a multiple of 128 (MXFP8 blocks of 32 along every GEMM axis, NVFP4 16x16 weight blocks, the RHT's 16).

Parallelism (``mesh``: a `jax.sharding.Mesh` with axes ("data", "tensor"); None = one device, nothing annotated):
  * data parallel: the batch is sharded over "data" (`batch_sharding`), parameters and optimizer state replicated
    over it; XLA all-reduces the weight gradients.
  * tensor parallel (Megatron): the qkv and MLP-up kernels [in, out] (and their biases) are split by columns over
    "tensor", the attention-output and MLP-down kernels by rows (`nnx.with_partitioning` annotations, which the
    optimizer state inherits); q, k and v are constrained to heads split over "tensor", so attention runs per head
    shard and its output enters the row-split projection already split along its input features. The fused qkv
    kernel keeps its [q | k | v] column order (the single-device model is unchanged), so a column shard holds a
    contiguous slice of [q | k | v] rather than the q, k and v of its heads: XLA moves the misplaced heads between
    tensor shards (collective-permute / all-to-all; a third of the qkv activation with 2 tensor shards, in fprop and
    again for its gradient). A head-major column order would avoid that, at the price of another model.
  Embedding, norms and logits head stay replicated. MoE blocks: data parallel only (experts and router replicated;
  `mesh_problems` rejects tensor > 1: neither expert parallelism nor a per-expert Megatron split is implemented).
  The jax_fp4 primitives partition themselves (custom_partitioning): quantize runs per shard with the tensor amax
  reduced across shards, so every quantized operand equals the unsharded one. `make_train_step(graphdef, state,
  mesh)` jits the step with these in / out shardings.
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

from jax_fp4.flax import diagnostics as fdiag
from jax_fp4.flax import nnx as fnnx
from jax_fp4.flax import policy as fpolicy
from jax_fp4.flax.moe import MoEMLP
from jax_fp4.formats import NVFP4 as NVFP4Format
from jax_fp4.policy import format_table
from jax_fp4.recipes import BF16, Recipe

VOCAB = 256  # byte-level tokens
DATA, TENSOR = "data", "tensor"  # mesh axis names


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

    @property
    def moe(self) -> bool:
        return self.moe_experts > 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

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
        return errs


def expert_recipe(recipe: Recipe) -> Recipe:
    """The recipe of the MoE expert GEMMs: `recipe`, except that a grouped (token) operand grouped quantize cannot
    encode (NVFP4 1x64: single-tensor only) becomes 1D NVFP4; the expert weights (quantized per expert) keep theirs.
    Only nvfp4-1x64 changes: its fprop x then uses 1x16 blocks with one tensor scale per expert group."""
    fmts = {}
    for name in ("fprop_x", "wgrad_x", "dgrad_dy", "wgrad_dy"):
        f = getattr(recipe, name)
        if isinstance(f, NVFP4Format) and (f.local_1x64 or f.scaling_2d):
            fmts[name] = f.replace(local_1x64=False, scaling_2d=False)
    return dataclasses.replace(recipe, name=f"{recipe.name}-experts", **fmts) if fmts else recipe


def attention_implementation():
    """"cudnn" (the fused flash-attention kernel) when the default backend is a GPU, else None (XLA's)."""
    return "cudnn" if jax.default_backend() == "gpu" else None


def rope(x, base):
    """Rotary position embedding of x [B, T, H, Dh] (pairs (i, i + Dh/2) rotated by position / base^(2i/Dh))."""
    _, t, _, dh = x.shape
    inv = base ** (-jnp.arange(0, dh // 2, dtype=jnp.float32) * 2.0 / dh)
    ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]  # [T, Dh/2]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _annotate(init, spec, mesh):
    """init with the mesh axes of its dimensions attached (`nnx.with_partitioning`), or init itself without a mesh."""
    return init if mesh is None else nnx.with_partitioning(init, spec, mesh=mesh)


class Block(nnx.Module):
    """Pre-norm transformer block: x + out(attention(qkv(LN(x)))), then x + MLP(LN(x)).

    mesh: None, or a Mesh with axes ("data", "tensor"): qkv and MLP-up split by columns, out and MLP-down by rows
    over "tensor", q / k / v by heads (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, recipe: Recipe, rngs: nnx.Rngs, dtype=jnp.bfloat16, mesh=None):
        d = cfg.d_model
        self.cfg = cfg
        col = dict(kernel_init=_annotate(fnnx.default_kernel_init, (None, TENSOR), mesh),
                   bias_init=_annotate(fnnx.default_bias_init, (TENSOR,), mesh))
        self.qkv = fnnx.LayerNormDense(d, 3 * d, recipe=recipe, dtype=dtype, rngs=rngs, **col)
        # GPT-2 style: the residual projections start smaller (std / sqrt(2 * n_layers)).
        small = nnx.initializers.variance_scaling(1.0 / (2 * cfg.n_layers), "fan_in", "truncated_normal")
        self.out = fnnx.Dense(d, d, recipe=recipe, dtype=dtype, kernel_init=_annotate(small, (TENSOR, None), mesh),
                              rngs=rngs)
        if cfg.moe:  # replicated (data parallel only: see mesh_problems)
            self.mlp = MoEMLP(d, cfg.mlp_ratio * d, cfg.moe_experts, recipe=expert_recipe(recipe),
                              top_k=cfg.moe_top_k, activation="gelu", norm="layernorm", dtype=dtype, rngs=rngs)
        else:
            self.mlp = fnnx.LayerNormMLP(d, cfg.mlp_ratio * d, recipe=recipe, activation="gelu", dtype=dtype,
                                         rngs=rngs, down_kernel_init=_annotate(fnnx.default_kernel_init,
                                                                               (TENSOR, None), mesh),
                                         down_bias_init=fnnx.default_bias_init, **col)
        self.heads = None if mesh is None else NamedSharding(mesh, P(DATA, None, TENSOR, None))  # [B, T, H, Dh]

    def __call__(self, x):
        """(x [B, T, d] after the block, the MoE load-balancing loss float32 (0 for a dense MLP))."""
        b, t, d = x.shape
        h, dh = self.cfg.n_heads, self.cfg.head_dim
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * h, dh), 3, axis=2)
        if self.heads is not None:
            q, k, v = (jax.lax.with_sharding_constraint(a, self.heads) for a in (q, k, v))
        q, k = rope(q, self.cfg.rope_base), rope(k, self.cfg.rope_base)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention_implementation())
        x = x + self.out(a.reshape(b, t, d))
        if self.cfg.moe:
            y, aux = self.mlp(x, return_aux_loss=True)
            return x + y, aux
        return x + self.mlp(x), jnp.zeros((), jnp.float32)


class GPT(nnx.Module):
    """Decoder-only language model: tokens int32 [B, T] -> logits float32 [B, T, vocab]."""

    def __init__(self, cfg: ModelConfig, recipe: Recipe, rngs: nnx.Rngs, dtype=jnp.bfloat16, mesh=None):
        self.cfg = cfg
        self.recipe = recipe
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=dtype,
                               embedding_init=nnx.initializers.normal(0.02), rngs=rngs)

        if cfg.scan_layers:  # parameters [n_layers, ...], each layer with its own init draws and rng streams
            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=_LAYER_AXIS)
            def stacked(rngs):
                return Block(cfg, recipe, rngs, dtype, mesh)

            self.blocks = stacked(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, recipe, rngs, dtype, mesh) for _ in range(cfg.n_layers)])
        self.norm = nnx.LayerNorm(cfg.d_model, epsilon=1e-6, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, dtype=dtype, rngs=rngs)

    def embed_tokens(self, tokens):
        """bfloat16 [B, T, d_model]: the embedding rows of tokens, as one_hot(tokens) @ embedding.

        The same values as `self.embed(tokens)` (one nonzero product per output, exact), but the embedding's
        gradient becomes a [vocab, B*T] x [B*T, d_model] GEMM instead of the scatter-add of a gather, whose atomic
        adds serialise on the few byte values text repeats (spaces, 'e', newlines): on an H100 at 32k tokens a step
        that scatter cost more than the rest of the step's kernels. Byte vocabularies (256) keep the one-hot small.
        """
        e = self.embed
        return jax.nn.one_hot(tokens, self.cfg.vocab, dtype=e.dtype) @ e.embedding[...].astype(e.dtype)

    def __call__(self, tokens, *, return_aux_loss: bool = False):
        """logits; with return_aux_loss also the blocks' mean MoE load-balancing loss (0 without MoE)."""
        x = self.embed_tokens(tokens)
        if self.cfg.scan_layers:
            x, aux = _scan_blocks(x, self.blocks)
        else:
            aux = []
            for block in self.blocks:
                x, a = block(x)
                aux.append(a)
            aux = jnp.stack(aux)
        logits = self.head(self.norm(x)).astype(jnp.float32)
        return (logits, jnp.mean(aux)) if return_aux_loss else logits


_LAYER_AXIS = {nnx.PARTITION_NAME: None}  # the stacked layer axis: unsharded (inserted into the sharding annotations)


@nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0), transform_metadata=_LAYER_AXIS)
def _scan_blocks(x, block):
    return block(x)  # (x, aux): the load-balancing losses stacked [n_layers]


def make_model(cfg: ModelConfig, recipe: Recipe, seed: int, mesh=None) -> GPT:
    """A fresh GPT; with a mesh its parameters are created sharded (the same values as without)."""
    return GPT(cfg, recipe, nnx.Rngs(params=seed, quantize=seed + 1), mesh=mesh)


def loss_terms(model: GPT, batch):
    """(objective, (cross-entropy, aux)) of batch uint8/int32 [B, T + 1]: the mean next-byte cross-entropy (nats),
    the blocks' mean MoE load-balancing loss aux (0 without MoE), objective = cross-entropy + moe_aux_weight * aux."""
    batch = batch.astype(jnp.int32)
    logits, aux = model(batch[:, :-1], return_aux_loss=True)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    return (ce + model.cfg.moe_aux_weight * aux if model.cfg.moe else ce), (ce, aux)


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


def make_mesh(data: int, tensor: int):
    """A (data, tensor) `jax.sharding.Mesh` over the first data * tensor devices (Auto axes: XLA propagates the
    annotations; jax.make_mesh's device order suits the interconnect)."""
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((data, tensor), (DATA, TENSOR), axis_types=auto, devices=jax.devices()[:data * tensor])


def mesh_problems(cfg: ModelConfig, batch: int, data: int, tensor: int) -> list[str]:
    """Why a (data, tensor) mesh does not suit this model and batch (empty when it does): the batch splits over
    "data" and every data shard keeps whole 128-token blocks; the heads (hence qkv, the attention output and the MLP)
    split over "tensor" in slices of whole 32-element MXFP8 blocks (NVFP4 1x64 windows of 64 may straddle shards:
    then quantize gathers that axis, see `mesh_notes`)."""
    errs = []
    if batch % data:
        errs.append(f"--batch {batch} does not split over the data axis ({data})")
    elif (batch // data * cfg.seq) % 128:
        errs.append(f"{batch // data} sequences x seq {cfg.seq} = {batch // data * cfg.seq} tokens per data shard: "
                    "must be a multiple of 128 (the quantized GEMMs' blocks along the token axis must not straddle "
                    "shards)")
    if cfg.n_heads % tensor:
        errs.append(f"the {cfg.n_heads} attention heads (d_model {cfg.d_model} / head size {cfg.head_dim}) do not "
                    f"split over the tensor axis ({tensor})")
    elif (cfg.d_model // tensor) % 32:
        errs.append(f"d_model {cfg.d_model} / tensor {tensor} = {cfg.d_model // tensor} features per shard: must be a "
                    "multiple of 32 (MXFP8 blocks must not straddle shards)")
    if cfg.moe and tensor > 1:
        errs.append(f"--moe supports data parallelism only (tensor 1, e.g. --mesh {data * tensor}x1): the experts are "
                    "replicated, neither expert parallelism nor a tensor split of the experts is implemented")
    return errs


def mesh_notes(cfg: ModelConfig, recipe: Recipe, tensor: int) -> list[str]:
    """Tensor-split widths that the recipe's quantize must gather on this mesh (correct results, an all-gather per
    use): NVFP4 1x64 windows of 64 that would straddle shards."""
    local_1x64 = any(getattr(f, "local_1x64", False) for f in recipe.formats())
    widths = {"the attention output's input features": cfg.d_model // tensor,
              "the qkv kernel's columns": 3 * cfg.d_model // tensor,
              "the MLP's hidden features": cfg.mlp_ratio * cfg.d_model // tensor}
    split = [f"{name} ({n} per shard)" for name, n in widths.items() if n % 64]
    if local_1x64 and tensor > 1 and split:
        return [f"{recipe.name}: quantize gathers {', '.join(split)}: not a multiple of the 64-element 1x64 windows"]
    return []


def batch_sharding(mesh):
    """The sharding of a token batch [B, T + 1]: B split over "data"."""
    return NamedSharding(mesh, P(DATA, None))


def state_shardings(state, mesh):
    """NamedShardings of an nnx state from its variables' annotations (unannotated: replicated)."""
    return nnx.get_named_sharding(state, mesh)


def make_train_step(graphdef, state=None, mesh=None, diagnostics: bool = False):
    """train_step(state, batch) -> (state, {"loss", "aux_loss"}): ONE jax.jit of forward, backward (quantized GEMMs
    per the recipe, fresh stochastic-rounding keys from the layers' rng streams, whose counters live in `state`),
    clipping and the AdamW update, on the functional state (model, optimizer) of `nnx.split`. loss: the cross-entropy,
    aux_loss: the mean MoE load-balancing loss (0 without MoE), both of the parameters before the update (the gradient
    is that of `loss_fn`, which adds the weighted aux_loss); the input state's buffers are donated.

    diagnostics: the step also returns {layer path: float32 [..., 6, 6]}, the quantization statistics of every
    jax_fp4 Dense layer's six GEMM operands (`jax_fp4.flax.diagnostics.value_and_grad`; the same update).

    With a mesh, the step is jitted with in / out shardings: `state` (an example state, for its annotations) keeps
    `state_shardings`, the batch `batch_sharding`, the losses are replicated."""

    def train(state, batch):
        model, opt = nnx.merge(graphdef, state)
        if diagnostics:
            (_, (ce, aux)), grads, stats = fdiag.value_and_grad(loss_terms, has_aux=True)(model, batch)
        else:
            (_, (ce, aux)), grads = nnx.value_and_grad(loss_terms, has_aux=True)(model, batch)
        opt.update(model, grads)
        losses = {"loss": ce, "aux_loss": aux}
        return (nnx.state((model, opt)), losses, stats) if diagnostics else (nnx.state((model, opt)), losses)

    if mesh is None:
        return jax.jit(train, donate_argnums=0)
    shardings = state_shardings(state, mesh)
    rep = NamedSharding(mesh, P())  # P(): every loss and statistic
    return jax.jit(train, in_shardings=(shardings, batch_sharding(mesh)),
                   out_shardings=(shardings, rep, rep) if diagnostics else (shardings, rep), donate_argnums=0)


def build(cfg: ModelConfig, recipe: Recipe, opt_cfg: OptConfig, seed: int, mesh=None):
    """(graphdef, state, train_step) of a fresh model and its AdamW state; with a mesh, the state is placed on it
    (see make_train_step) and the step is the sharded one."""
    model = make_model(cfg, recipe, seed, mesh)
    opt = nnx.Optimizer(model, make_optimizer(opt_cfg), wrt=nnx.Param)
    graphdef, state = nnx.split((model, opt))
    if mesh is not None:
        state = jax.device_put(state, state_shardings(state, mesh))
    return graphdef, state, make_train_step(graphdef, state, mesh)


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


def build_phases(cfg: ModelConfig, recipe: Recipe, policies, opt_cfg: OptConfig, seed: int, mesh=None) -> Phases:
    """A fresh model and AdamW state trained with `recipe`, the layers' recipes set per phase by `policies` (a
    sequence of `jax_fp4.policy.Policy`, e.g. the two phases of a `jax_fp4.schedule.PrecisionSwitch`).

    MoE blocks' MLPs take the policy's recipe for their path through `expert_recipe`. A phase whose recipe needs
    stochastic rounding where the model's does not gets rng streams seeded from seed + 2 (unscanned blocks).

    Raises:
      jax_fp4.policy.UnmatchedRuleError: a rule matches no layer (e.g. per-block rules on scanned blocks).
      ValueError: the phases' states differ (cannot happen unless a scanned layer needs a new rng stream).
    """
    model = make_model(cfg, recipe, seed, mesh)
    rngs = nnx.Rngs(quantize=seed + 2)
    for pol in policies:  # first pass: every rng stream any phase needs exists in every phase
        _apply_policy(pol, model, rngs)
    opt = nnx.Optimizer(model, make_optimizer(opt_cfg), wrt=nnx.Param)
    graphdefs, tables, state = [], [], None
    for pol in policies:
        _apply_policy(pol, model, rngs)
        tables.append(_recipe_table(pol, model))
        graphdef, st = nnx.split((model, opt))
        if state is not None and jax.tree.structure(st) != jax.tree.structure(state):
            raise ValueError("build_phases: the phases' states differ")
        graphdefs.append(graphdef)
        state = st
    if mesh is not None:
        state = jax.device_put(state, state_shardings(state, mesh))
    return Phases(graphdefs, state, [make_train_step(g, state, mesh) for g in graphdefs],
                  [make_train_step(g, state, mesh, diagnostics=True) for g in graphdefs], tables)


def _recipe_table(policy, model) -> str:
    """The layer -> recipe table of the model as built (MoE experts: their `expert_recipe`) and the deciding rule."""
    rows = []
    for path, node in fpolicy.layers(model).items():
        rule = policy.match(path)
        rows.append((path, node.recipe.name, "default" if rule is None else repr(rule.pattern)))
    return format_table(rows)


def _apply_policy(policy, model, rngs):
    fpolicy.apply(policy, model, rngs=rngs)
    for _, node in nnx.iter_graph(model):  # grouped quantize has no 1x64 encode: see expert_recipe
        if isinstance(node, MoEMLP) and expert_recipe(node.recipe) != node.recipe:
            node.recipe = expert_recipe(node.recipe)


def count_params(cfg: ModelConfig, active: bool = False) -> int:
    """Parameters of the model; active: those one token uses (top_k of the experts' weights)."""
    model = nnx.eval_shape(lambda: make_model(cfg, BF16(), 0))
    n = sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if active and cfg.moe:
        per_expert = cfg.n_layers * 2 * cfg.d_model * cfg.mlp_ratio * cfg.d_model  # up [d, h] + down [h, d]
        n -= (cfg.moe_experts - cfg.moe_top_k) * per_expert
    return n


def flops_per_token(cfg: ModelConfig) -> float:
    """Model FLOPs of one training token (forward + backward), the PaLM / Chinchilla count used for MFU:
    6 x (the GEMM weights one token uses: qkv, out, MLP (top_k experts with MoE), router, logits head) + the attention
    products 12 x n_layers x d_model x seq (q.k^T and p.v, forward and backward, causal mask not discounted)."""
    d, L = cfg.d_model, cfg.n_layers
    mlp = 2 * d * cfg.mlp_ratio * d * (cfg.moe_top_k if cfg.moe else 1) + (d * cfg.moe_experts if cfg.moe else 0)
    gemm = L * (3 * d * d + 3 * d + d * d + mlp) + d * cfg.vocab
    return 6.0 * gemm + 12.0 * L * d * cfg.seq
