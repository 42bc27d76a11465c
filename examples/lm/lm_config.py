"""The run configuration of train_lm.py: the presets, the command line (`make_parser`, `parse_args`) and
`RunConfig`, what one training run needs besides its recipe and data.

`parse_args` applies a preset, then the flags that override it, checks the combination (block sizes, the mesh against
the device count, MoE and precision flags) and exits through argparse with a message naming the bad flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from pathlib import Path

import jax
import lm_checkpoint
import lm_distributed
import lm_layers
import lm_mesh
import lm_model
import lm_precision

from jax_fp4 import recipes
from jax_fp4.distributed import REDUCE_DTYPES

DESCRIPTION = ("Train a GPT- or Llama-style decoder whose attention projections and MLPs run through jax_fp4's "
               "quantized layers.")

VAL_TOKENS = 2**20  # the presets' final validation set (small and up): 1,048,576 held-out tokens
PRESETS = {
    # tiny: two CPU cores, ~1 min per quantized recipe (mostly XLA compiling the bit-exact reference kernels)
    "tiny": dict(d_model=64, layers=2, head_dim=32, seq=64, batch=8, steps=80, lr=3e-3, warmup=10, eval_every=20,
                 eval_batches=4, log_every=5, ckpt_every=0, scan=False),
    # small: one H100 GPU; sized so that --compare (5 recipes x 2000 steps) stays within about 8 minutes
    "small": dict(d_model=384, layers=4, head_dim=64, seq=256, batch=32, steps=2000, lr=1e-3, warmup=100,
                  eval_every=250, eval_batches=8, log_every=25, ckpt_every=1000, scan=True, val_tokens=VAL_TOKENS),
    # medium: one GPU, 85.5M parameters (12 x 12 d_model^2 + embedding and head), 32k tokens per step on the
    # site-packages corpus (~65M tokens in 2000 steps, so the model does not run through its data many times).
    # Unscanned: on an H100 the scanned stack's per-layer slicing and gradient stacking cost ~30 ms of a ~48 ms
    # bf16 step; unrolled, XLA compiles 12 blocks (~15 s) once per recipe.
    "medium": dict(d_model=768, layers=12, head_dim=64, seq=512, batch=64, steps=2000, lr=6e-4, warmup=200,
                   eval_every=250, eval_batches=8, log_every=25, ckpt_every=1000, scan=False, corpus="site-packages",
                   val_tokens=VAL_TOKENS),
    # large: Llama-style (RMSNorm, SwiGLU, grouped-query attention, untied embeddings), ~1.0B parameters, seq 2048,
    # BPE tokens (32768, trained on the corpus), scanned blocks checkpointed keeping the quantized residuals; 32k
    # tokens per step, meant for an fsdp mesh (--mesh 1x2x1 on 2 GPUs).
    "large": dict(d_model=2048, layers=16, head_dim=128, kv_heads=4, mlp_hidden=7168, seq=2048, batch=16, steps=300,
                  lr=3e-4, warmup=100, eval_every=100, eval_batches=4, log_every=10, ckpt_every=0, scan=True,
                  corpus="site-packages", arch="llama", remat="quantized", tokenizer="bpe", vocab=32768,
                  val_tokens=VAL_TOKENS),
    # large-350m: the large architecture at ~0.34B parameters (d_model 1024, 24 blocks), 1000 steps of 32k tokens.
    # Peak lr 3e-4: at 6e-4 (--lr 6e-4, the earlier setting; lower loss) two runs of one seed end ten times further
    # apart (docs/performance.md, "Measuring gaps").
    "large-350m": dict(d_model=1024, layers=24, head_dim=64, kv_heads=4, mlp_hidden=2816, seq=2048, batch=16,
                       steps=1000, lr=3e-4, warmup=100, eval_every=250, eval_batches=4, log_every=25, ckpt_every=0,
                       scan=True, corpus="site-packages", arch="llama", remat="quantized", tokenizer="bpe",
                       vocab=32768, val_tokens=VAL_TOKENS),
    # moe-large: the large (Llama) architecture at d_model 1024 with fine-grained mixture-of-experts MLPs: 64 SwiGLU
    # experts of width 512 per block, top-8 routing, ~1.72B parameters of which ~0.31B active per token; seq 2048,
    # BPE, 32k tokens per step; meant for an expert mesh (--mesh 1x1x1x2 on 2 GPUs: 32 experts per GPU). Peak lr
    # 3e-4, as large-350m's (at 6e-4 runs of one seed part at this batch: docs/performance.md, "Measuring gaps").
    # Blocks unrolled, as measured in docs/performance.md ("MoE expert parallelism"); --scan scans them.
    "moe-large": dict(d_model=1024, layers=16, head_dim=64, kv_heads=4, mlp_hidden=512, moe=64, top_k=8, seq=2048,
                      batch=16, steps=300, lr=3e-4, warmup=100, eval_every=100, eval_batches=4, log_every=10,
                      ckpt_every=0, scan=False, corpus="site-packages", arch="llama", remat="quantized",
                      tokenizer="bpe", vocab=32768, val_tokens=VAL_TOKENS),
}
CORPORA = ("stdlib", "site-packages")
TOKENIZERS = ("bytes", "bpe")
MOE_EXPERTS, MOE_TOP_K, MOE_AUX_WEIGHT = 8, 2, 0.01  # --moe's defaults


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: lm_model.ModelConfig
    batch: int
    steps: int
    lr: float
    warmup: int
    eval_every: int
    eval_batches: int
    log_every: int
    ckpt_every: int
    seed: int
    mesh: tuple[int, int, int, int] | None = None  # (data, fsdp, tensor, expert); None: one device
    fsdp_reduce: str = "float32"  # fsdp > 1: the quantized layers' reduce_dtype (jax_fp4.distributed.shard_recipe)
    deterministic: bool = False  # XLA's deterministic ops and XLA attention (jax_fp4.determinism)
    final_eval_batches: int = 0  # batches of the run's last evaluation (0: eval_batches)

    def __post_init__(self):
        if self.final_eval_batches < self.eval_batches:
            object.__setattr__(self, "final_eval_batches", self.eval_batches)

    def resume_key(self) -> dict:
        """What a checkpoint must agree on to be resumed (the rest, e.g. --steps or the mesh, may change). Fields
        added since older checkpoints are left out at their defaults (dense: the moe_ fields), so those resume."""
        default = lm_model.ModelConfig()
        model = {k: v for k, v in dataclasses.asdict(self.model).items()
                 if (self.model.moe or not k.startswith("moe_")) and k not in RUN_ONLY_MODEL_FIELDS
                 and not (k in NEW_MODEL_FIELDS and v == getattr(default, k))}
        return {"model": model, "batch": self.batch, "lr": self.lr, "warmup": self.warmup, "seed": self.seed}


NEW_MODEL_FIELDS = ("arch", "kv_heads", "mlp_hidden", "remat", "vocab", "moe_capacity")
# how a step runs, not what it trains: a checkpoint resumes under either value
RUN_ONLY_MODEL_FIELDS = ("attention", "moe_gemm")


# ---- command line ----------------------------------------------------------------------------------------------------
def _int_at_least(low):
    def parse(s):
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {v}")
        return v

    return parse


def _positive_float(s):
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s}")
    return v


def _mesh_shape(s):
    """(data, fsdp, tensor, expert) of "DATAxTENSOR" (fsdp 1, expert 1), "DATAxFSDPxTENSOR" (expert 1) or
    "DATAxFSDPxTENSORxEXPERT"."""
    parts = re.split(r"\s*[xX]\s*", s.strip())
    if len(parts) not in (2, 3, 4) or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"{s!r} is not DATAxTENSOR or DATAxFSDPxTENSOR (or DATAxFSDPxTENSORxEXPERT) "
                                         "with positive sizes, e.g. 2x1, 1x2, 2x4, 1x2x1 or 1x1x1x2")
    sizes = [int(p) for p in parts]
    return (sizes[0], 1, sizes[1], 1) if len(sizes) == 2 else tuple(sizes) + (1,) * (4 - len(sizes))


def _nonnegative_float(s):
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {s}")
    return v


def attention_problem(deterministic: bool, attention: str | None, mesh, names) -> str | None:
    """Why --deterministic --attention cudnn cannot run these recipes on this mesh (XLA aborts compiling a quantized
    step with cuDNN attention under deterministic ops on several devices; jaxlib 0.11.2), else None."""
    quantized = [n for n in names if recipes.by_name(n).quantized]
    if not (deterministic and attention == "cudnn" and mesh is not None and math.prod(mesh) > 1 and quantized):
        return None
    return (f"--deterministic --attention cudnn: XLA aborts compiling the quantized step ({', '.join(quantized)}) "
            f"with cuDNN attention under deterministic ops on a mesh of several devices "
            f"({'x'.join(map(str, mesh))}; jaxlib 0.11.2); use --attention xla there, or one device")


def _recipe_name(s):
    """A recipe name recipes.by_name knows: RECIPES' defaults or a variant (e.g. nvfp4-fwd-mxfp8-bwd-4over6)."""
    return _recipe_list(s)[0] if "," not in s else _recipe_list("")


def _recipe_list(s):
    names = [n.strip() for n in s.split(",") if n.strip()]
    bad = []
    for n in names:  # any name recipes.by_name knows (e.g. nvfp4-fwd-mxfp8-bwd-4over6), not only RECIPES' defaults
        try:
            recipes.by_name(n)
        except ValueError:
            bad.append(n)
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown recipe(s) {bad or s!r}; choose from {sorted(recipes.RECIPES)} or "
                                         "a variant recipes.by_name knows")
    return list(dict.fromkeys(names))


def _existing_file(s):
    if not Path(s).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {s}")
    return Path(s)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=DESCRIPTION, epilog="Presets: " + "; ".join(
        f"{k}: d_model {v['d_model']}, {v['layers']} layers, seq {v['seq']}, batch {v['batch']}, {v['steps']} steps"
        for k, v in PRESETS.items()))
    which = p.add_mutually_exclusive_group()
    which.add_argument("--recipe", type=_recipe_name, default="nvfp4", metavar="|".join(sorted(recipes.RECIPES)),
                       help="the jax_fp4 training recipe of the quantized layers (default nvfp4)")
    which.add_argument("--compare", action="store_true", help="train every recipe (bf16 first), same seed and data")
    which.add_argument("--recipes", type=_recipe_list, metavar="R1,R2,...",
                       help="train these recipes (comma-separated, in this order), same seed and data")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model and run size (default tiny)")
    p.add_argument("--steps", type=_int_at_least(1), help="training steps per recipe (default: the preset's)")
    p.add_argument("--batch", type=_int_at_least(1), help="sequences per batch (batch x seq: a multiple of 128)")
    p.add_argument("--seq", type=_int_at_least(8), help="sequence length in bytes")
    p.add_argument("--d-model", type=_int_at_least(64), help="model width (a multiple of 64)")
    p.add_argument("--layers", type=_int_at_least(1), help="transformer blocks")
    p.add_argument("--scan", action=argparse.BooleanOptionalAction,
                   help="stack the blocks and nnx.scan over them (one compiled block; default: small yes, tiny no)")
    p.add_argument("--lr", type=_positive_float, help="peak learning rate")
    p.add_argument("--warmup", type=_int_at_least(0), help="linear warmup steps")
    p.add_argument("--eval-every", type=_int_at_least(1), help="validate every N steps (and at the end)")
    p.add_argument("--eval-batches", type=_int_at_least(1), help="validation batches per evaluation")
    p.add_argument("--val-tokens", type=_int_at_least(0),
                   help="the run's last evaluation covers at least this many held-out tokens (the same windows in "
                        "every run; its standard error is reported); 0: --eval-batches (default: the preset's, "
                        f"{VAL_TOKENS:,} for small and up)")
    p.add_argument("--deterministic", action="store_true",
                   help="bit-reproducible runs: the step compiled with XLA's deterministic ops and attention run by "
                        "XLA instead of cuDNN (jax_fp4.determinism); summary.json records a checksum of the model")
    p.add_argument("--attention", choices=("xla", "cudnn"),
                   help="attention: cuDNN's fused flash-attention kernel (on GPUs; the default without "
                        "--deterministic) or XLA's (the default with --deterministic). --deterministic --attention "
                        "cudnn keeps the fused kernel under XLA's deterministic ops on one device (a bf16 step lost "
                        "3 %% of its tokens/s that way, against about 3x with XLA's attention at seq 2048), each "
                        "block or scanned segment with its own full causal window so that no two cuDNN graphs are "
                        "identical (jax_fp4.determinism.distinct_causal_window); a quantized recipe on a mesh of "
                        "several devices is refused there (XLA aborts compiling it)")
    p.add_argument("--log-every", type=_int_at_least(1), help="a curves.csv row (train loss, tokens/s) every N steps")
    p.add_argument("--ckpt-every", type=_int_at_least(0), help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--arch", choices=lm_model.ARCHS, help="block kind (default: the preset's; gpt for tiny / small / "
                                                          "medium, llama for large)")
    p.add_argument("--heads", type=_int_at_least(1), help="attention heads (default d_model / the preset's head size)")
    p.add_argument("--kv-heads", type=_int_at_least(1), help="llama: key / value heads (grouped-query attention)")
    p.add_argument("--mlp-hidden", type=_int_at_least(64), help="MLP width (default 4 x d_model, or the preset's)")
    p.add_argument("--remat", choices=lm_layers.REMAT,
                   help="activation checkpointing per block: none, quantized (keep the quantized GEMM residuals, "
                        "recompute the rest), full (default: the preset's)")
    p.add_argument("--tokenizer", choices=TOKENIZERS, help="bytes (vocab 256) or bpe (a byte-level BPE trained on "
                                                           "the corpus, cached under --out; default: the preset's)")
    p.add_argument("--vocab", type=_int_at_least(257), help="with --tokenizer bpe: the vocabulary size")
    p.add_argument("--mesh", type=_mesh_shape, metavar="DATAx[FSDPx]TENSOR[xEXPERT]",
                   help="shard the step over a data x fsdp x tensor (x expert) device mesh, e.g. 2x1 (data "
                        "parallel), 1x2x1 (fsdp), 1x2 (tensor parallel), 2x4, 1x1x1x2 (MoE: experts split over 2 "
                        "devices), 2x1x1x2; the product must equal the device count (default: one device)")
    p.add_argument("--fsdp-reduce", choices=REDUCE_DTYPES,
                   help="with a mesh of fsdp > 1 (the quantized layers gather their weights' codes and scales, "
                        "jax_fp4.distributed.shard_recipe): sum the partial GEMM products of sharded contractions "
                        "across devices in float32 (default; the unsharded bits) or in the GEMM's output dtype "
                        "(output: bfloat16, half the bytes)")
    p.add_argument("--moe", type=_int_at_least(2), nargs="?", const=MOE_EXPERTS, metavar="E",
                   help=f"mixture-of-experts MLPs with E experts per block (default {MOE_EXPERTS} when given alone)")
    p.add_argument("--top-k", type=_int_at_least(1), help=f"with --moe: experts per token (default {MOE_TOP_K})")
    p.add_argument("--aux-weight", type=_nonnegative_float,
                   help=f"with --moe: weight of the load-balancing loss (default {MOE_AUX_WEIGHT}; 0: none)")
    p.add_argument("--capacity-factor", type=_positive_float,
                   help="with --moe on an expert mesh: rows per (source, destination) device pair in the all-to-all "
                        "buffers, as a multiple of the balanced share (jax_fp4.expert_parallel.capacity); "
                        "assignments past them are dropped (default: dropless)")
    p.add_argument("--grouped-gemm", choices=("xla", "tokamax"),
                   help="with --moe: who computes the expert GEMMs (jax_fp4.ragged_dot's implementation): xla "
                        "(default; XLA:GPU lowers them to dense dots over every expert) or tokamax (its GPU "
                        "grouped-GEMM kernels; pip install 'jax_fp4[tokamax]'). The same parameters either way")
    p.add_argument("--seed", type=int, default=0, help="initialization and data-order seed (default 0)")
    p.add_argument("--data", type=_existing_file, help="train on this text file instead of the Python stdlib")
    p.add_argument("--corpus", choices=CORPORA, help="the embedded corpus: the stdlib's .py files, or every .py under "
                                                     "site-packages (default: the preset's, stdlib for tiny / small)")
    p.add_argument("--stop-at", type=_int_at_least(1), metavar="STEP",
                   help="stop after this step (checkpointing) of a --steps long run; continue later with --resume")
    p.add_argument("--out", type=Path, help="output directory (default runs/<preset>)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoints in --out")
    p.add_argument("--collectives", action="store_true",
                   help="record the collectives of the compiled step in summary.json (count and bytes per kind, "
                        "per op of the program and per step, loop bodies times their trip counts; one more compile)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    lm_precision.add_arguments(p)
    lm_distributed.add_arguments(p)  # --distributed, --coordinator, --num-processes, --process-id, --init-timeout
    return p


def parse_args(argv=None):
    """(args, RunConfig, recipe names); bad flags exit through argparse with a message."""
    parser = make_parser()
    args = parser.parse_args(argv)
    v = dict(PRESETS[args.preset])
    for k in ("steps", "batch", "seq", "d_model", "layers", "lr", "warmup", "eval_every", "eval_batches", "log_every",
              "ckpt_every", "scan", "corpus", "arch", "kv_heads", "mlp_hidden", "remat", "tokenizer", "vocab",
              "val_tokens"):
        if getattr(args, k) is not None:
            v[k] = getattr(args, k)
    args.corpus = v.get("corpus", "stdlib")
    args.tokenizer = v.get("tokenizer", "bytes")
    if args.tokenizer == "bytes" and args.vocab is not None:
        parser.error("--vocab needs --tokenizer bpe (byte tokens: 256)")
    lm_precision.check(parser, args, v["layers"])
    if args.stop_at is not None and args.stop_at > v["steps"]:
        parser.error(f"--stop-at {args.stop_at} is beyond --steps {v['steps']}")
    if (v["batch"] * v["seq"]) % 128:
        parser.error(f"--batch {v['batch']} x --seq {v['seq']} = {v['batch'] * v['seq']} tokens per batch: must be a "
                     "multiple of 128 (the quantized GEMMs block the token axis in the weight gradient)")
    experts = args.moe if args.moe is not None else v.get("moe")  # a moe preset's experts and top-k
    for flag in ("top_k", "aux_weight", "capacity_factor", "grouped_gemm"):
        if experts is None and getattr(args, flag) is not None:
            parser.error(f"--{flag.replace('_', '-')} needs --moe")
    top_k = args.top_k if args.top_k is not None else v.get("top_k", MOE_TOP_K)
    moe = {} if experts is None else dict(
        moe_experts=experts, moe_top_k=top_k,
        moe_aux_weight=MOE_AUX_WEIGHT if args.aux_weight is None else args.aux_weight,
        moe_capacity=args.capacity_factor or 0.0, moe_gemm=args.grouped_gemm or "xla")
    if moe and not moe["moe_top_k"] <= moe["moe_experts"]:
        parser.error(f"--top-k {moe['moe_top_k']} exceeds the {moe['moe_experts']} experts of --moe")
    model = lm_model.ModelConfig(
        d_model=v["d_model"], n_layers=v["layers"], n_heads=args.heads or max(v["d_model"] // v["head_dim"], 1),
        seq=v["seq"], scan_layers=v["scan"], arch=v.get("arch", "gpt"), kv_heads=v.get("kv_heads", 0),
        mlp_hidden=v.get("mlp_hidden", 0), remat=v.get("remat", "none"),
        attention=args.attention or ("xla" if args.deterministic else "auto"),
        distinct_attention=bool(args.deterministic and args.attention == "cudnn"),
        vocab=v.get("vocab", 32768) if args.tokenizer == "bpe" else lm_model.VOCAB, **moe)
    for problem in model.validate():
        parser.error(problem)
    if args.fsdp_reduce is not None and (args.mesh is None or args.mesh[1] == 1):
        parser.error("--fsdp-reduce needs a --mesh DATAxFSDPxTENSOR with fsdp > 1, e.g. 1x2x1")
    if args.capacity_factor is not None and (args.mesh is None or args.mesh[3] == 1):
        parser.error("--capacity-factor needs an expert axis (--mesh DATAxFSDPxTENSORxEXPERT with expert > 1): "
                     "without one nothing is dispatched, nothing dropped")
    if args.mesh is not None:
        shape = "x".join(map(str, args.mesh if args.mesh[3] > 1 else args.mesh[:3]))
        for problem in lm_mesh.mesh_problems(model, v["batch"], *args.mesh):
            parser.error(f"--mesh {shape}: {problem}")
        devices, n = jax.devices(), math.prod(args.mesh)
        if n != len(devices):
            axes = "data x fsdp x tensor" + (" x expert" if args.mesh[3] > 1 else "")
            parser.error(f"--mesh {shape} needs {axes} = {n} devices; there are "
                         f"{len(devices)} ({devices[0].platform}): the product must equal the device count")
    cfg = RunConfig(model=model, batch=v["batch"], steps=v["steps"], lr=v["lr"], warmup=v["warmup"],
                    eval_every=v["eval_every"], eval_batches=v["eval_batches"], log_every=v["log_every"],
                    ckpt_every=v["ckpt_every"], seed=args.seed, mesh=args.mesh,
                    fsdp_reduce=args.fsdp_reduce or "float32", deterministic=args.deterministic,
                    final_eval_batches=-(-v.get("val_tokens", 0) // (v["batch"] * v["seq"])))
    args.out = args.out if args.out is not None else Path("runs") / args.preset
    names = (["bf16"] + sorted(n for n in recipes.RECIPES if n != "bf16") if args.compare else
             args.recipes if args.recipes else [args.recipe])
    problem = attention_problem(args.deterministic, args.attention, args.mesh, names)
    if problem:
        parser.error(problem)
    runs = [lm_precision.run_name(n, args, seed) for seed in (args.seeds or [None]) for n in names]
    if args.resume and not any(lm_checkpoint.latest_step(args.out / "checkpoints" / n) is not None for n in runs):
        parser.error(f"--resume: no checkpoint of {', '.join(runs)} under {args.out / 'checkpoints'}")
    return args, cfg, names
