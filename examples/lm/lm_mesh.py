"""Device meshes of train_lm.py: axes ("data", "fsdp", "tensor", "expert"), the parameter and batch shardings, and
the checks.

  * "data": the batch is split over it; parameters and optimizer state are replicated over it.
  * "fsdp": the batch is split over it too, and every matrix (GEMM kernels, embedding, logits head) is split over it
    along the axis tensor parallelism leaves whole (ZeRO-3 / FSDP: each device keeps 1/fsdp of the parameters and of
    the AdamW moments, `nnx.Optimizer` inheriting the parameters' annotations). XLA's SPMD partitioner gathers a
    bfloat16 weight where a bfloat16 layer uses it (embedding, logits head, layers a policy keeps in bf16). A
    quantized layer's recipe becomes `jax_fp4.distributed.shard_recipe(recipe, fsdp_axes="fsdp", reduce_dtype=...)`
    (`layer_recipe`): each device quantizes its own slice of the weight and the codes and block scales are
    all-gathered, not the weight; reduce_dtype (train_lm --fsdp-reduce) "float32" sums the partial GEMM products
    across shards in float32 (bit-exact), "output" in the GEMM's output dtype (bfloat16: half the bytes). XLA reduces
    the gradients of the rest as it chooses (`train_lm --collectives` lists what a compiled step does).
  * "tensor": Megatron tensor parallelism (column-split qkv / MLP-up, row-split attention output / MLP-down, heads).
  * "expert" (MoE models): expert parallelism. The batch is split over it too; every MoE layer is a
    `jax_fp4.flax.moe_ep.ExpertParallelMoEMLP` whose expert kernels [E, ...] are split over it (E / expert experts
    per device, replicated over data and fsdp), the tokens moving to their experts' devices and back by all-to-all
    (quantized dispatch for quantized recipes); the dense layers treat it as another data axis.
Norm scales and biases (small) are replicated over "fsdp". An axis of size 1 is left out of every annotation.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_fp4.distributed import shard_recipe

DATA, FSDP, TENSOR, EXPERT = "data", "fsdp", "tensor", "expert"  # mesh axis names
AXES = (DATA, FSDP, TENSOR, EXPERT)
BATCH = (DATA, FSDP, EXPERT)  # the axes the token batch is split over


def make_mesh(data: int, fsdp: int, tensor: int, expert: int = 1):
    """A (data, fsdp, tensor, expert) `jax.sharding.Mesh` over the first data * fsdp * tensor * expert devices (Auto
    axes: XLA propagates the annotations; jax.make_mesh's device order suits the interconnect, the last axes the
    closest devices)."""
    auto = (jax.sharding.AxisType.Auto,) * 4
    n = data * fsdp * tensor * expert
    return jax.make_mesh((data, fsdp, tensor, expert), AXES, axis_types=auto, devices=jax.devices()[:n])


def _used(mesh, axis):
    return axis if mesh is not None and mesh.shape.get(axis, 1) > 1 else None


def param_axes(kind: str, mesh) -> tuple:
    """The mesh axes of a parameter's dimensions: kind "col" (a kernel [in, out] split by columns over "tensor":
    qkv, MLP-up), "row" ([in, out] split by rows: attention output, MLP-down), "embed" ([vocab, d]), "head"
    ([d, vocab]), "colvec" (the bias of a column-split kernel). The "fsdp" axis takes the dimension "tensor" leaves
    whole. Norm scales and other biases stay unannotated (replicated)."""
    fsdp = _used(mesh, FSDP)
    return {"col": (fsdp, TENSOR), "row": (TENSOR, fsdp), "embed": (fsdp, None), "head": (fsdp, None),
            "colvec": (TENSOR,)}[kind]


def layer_recipe(recipe, mesh, reduce_dtype: str = "float32"):
    """The recipe a quantized layer runs on `mesh`: with an "fsdp" axis of size > 1,
    `jax_fp4.distributed.shard_recipe(recipe, fsdp_axes="fsdp", reduce_dtype=reduce_dtype)` (quantized weight
    gathers; reduce_dtype "float32" or "output", `jax_fp4.distributed.REDUCE_DTYPES`); otherwise (no mesh, fsdp 1,
    an unquantized recipe such as bf16, or None) `recipe` itself.

    Raises:
      ValueError: an unknown reduce_dtype (from `shard_recipe`).
    """
    if _used(mesh, FSDP) is None or recipe is None or not recipe.quantized:
        return recipe
    return shard_recipe(recipe, fsdp_axes=FSDP, reduce_dtype=reduce_dtype)


def batch_sharding(mesh):
    """The sharding of a token batch [B, T + 1]: B split over "data", "fsdp" and "expert"."""
    return NamedSharding(mesh, P(BATCH, None))


def heads_sharding(mesh):
    """The sharding of q / k / v [B, T, heads, head_dim]: B over the batch axes, the heads over "tensor"."""
    return NamedSharding(mesh, P(BATCH, None, TENSOR, None))


def mesh_problems(cfg, batch: int, data: int, fsdp: int, tensor: int, expert: int = 1) -> list[str]:
    """Why a (data, fsdp, tensor, expert) mesh does not suit this model and batch (empty when it does): the batch
    splits over data x fsdp x expert and every shard keeps whole 128-token blocks; an expert axis needs an MoE model
    whose experts split evenly over it, and MoE models no tensor axis; the heads (and kv heads) split over "tensor" in
    slices of whole 32-element MXFP8 blocks; every fsdp-split dimension (d_model, the MLP width, the vocabulary)
    splits into whole 32-element blocks (NVFP4 1x64 windows of 64 may straddle shards: see `mesh_notes`)."""
    errs = []
    shards = data * fsdp * expert
    if batch % shards:
        axes = (f"data x fsdp axes ({data} x {fsdp})" if expert == 1 else
                f"data x fsdp x expert axes ({data} x {fsdp} x {expert})")
        errs.append(f"--batch {batch} does not split over the {axes}")
    elif (batch // shards * cfg.seq) % 128:
        errs.append(f"{batch // shards} sequences x seq {cfg.seq} = {batch // shards * cfg.seq} tokens per batch "
                    "shard: must be a multiple of 128 (the quantized GEMMs' blocks along the token axis must not "
                    "straddle shards)")
    if cfg.n_heads % tensor or cfg.kv % tensor:
        errs.append(f"the {cfg.n_heads} attention heads ({cfg.kv} key / value heads; d_model {cfg.d_model} / head "
                    f"size {cfg.head_dim}) do not split over the tensor axis ({tensor})")
    elif (cfg.d_model // tensor) % 32:
        errs.append(f"d_model {cfg.d_model} / tensor {tensor} = {cfg.d_model // tensor} features per shard: must be a "
                    "multiple of 32 (MXFP8 blocks must not straddle shards)")
    for name, n in (("d_model", cfg.d_model), ("the MLP width", cfg.hidden), ("the vocabulary", cfg.vocab)):
        if fsdp > 1 and (n % fsdp or (n // fsdp) % 32):
            errs.append(f"{name} {n} does not split over the fsdp axis ({fsdp}) into multiples of 32 (the MXFP8 "
                        "blocks of a weight must not straddle shards)")
    if cfg.moe and tensor > 1:
        errs.append(f"--moe has no tensor parallelism (tensor 1): split the experts over the expert axis instead, e.g. "
                    f"--mesh {data}x{fsdp}x1x{expert * tensor}")
    if expert > 1 and not cfg.moe:
        errs.append(f"an expert axis ({expert}) needs mixture-of-experts MLPs (--moe or a moe preset)")
    elif expert > 1 and cfg.moe_experts % expert:
        errs.append(f"the {cfg.moe_experts} experts do not split over the expert axis ({expert}): every device must "
                    "hold the same number of experts")
    return errs


def mesh_notes(cfg, recipe, tensor: int) -> list[str]:
    """Tensor-split widths that the recipe's quantize must gather on this mesh (correct results, an all-gather per
    use): NVFP4 1x64 windows of 64 that would straddle shards."""
    local_1x64 = any(getattr(f, "local_1x64", False) for f in recipe.formats())
    widths = {"the attention output's input features": cfg.n_heads * cfg.head_dim // tensor,
              "the qkv kernel's columns": (cfg.n_heads + 2 * cfg.kv) * cfg.head_dim // tensor,
              "the MLP's hidden features": cfg.hidden // tensor}
    split = [f"{name} ({n} per shard)" for name, n in widths.items() if n % 64]
    if local_1x64 and tensor > 1 and split:
        return [f"{recipe.name}: quantize gathers {', '.join(split)}: not a multiple of the 64-element 1x64 windows"]
    return []


def state_shardings(state, mesh):
    """NamedShardings of an nnx state from its variables' annotations (unannotated: replicated)."""
    from flax import nnx

    return nnx.get_named_sharding(state, mesh)
