"""Train a GPT- or Llama-style decoder whose attention projections and MLPs run through jax_fp4's quantized layers.

    python examples/lm/train_lm.py --compare --preset tiny --out runs/tiny          # every recipe, CPU: a few minutes
    python examples/lm/train_lm.py --recipe nvfp4 --preset small --steps 2000       # one recipe, one GPU
    python examples/lm/train_lm.py --recipe mxfp8 --data book.txt --resume --out runs/book
    python examples/lm/train_lm.py --compare --preset small --mesh 2x1      # 2 GPUs, data parallel (1x2: tensor)
    python examples/lm/train_lm.py --compare --moe 8 --top-k 2              # mixture-of-experts MLPs (8 experts, top-2)
    python examples/lm/train_lm.py --recipes bf16,nvfp4-fwd-mxfp8-bwd --preset large --mesh 1x2x1    # ~1B, 2 GPUs, fsdp

The model (examples/lm/lm_model.py): a pre-norm decoder with rotary positions; qkv, the attention output projection
and the MLP are `jax_fp4.flax.nnx` layers following the recipe, the embedding, norms, attention scores and logits head
stay bfloat16. --arch gpt (LayerNorm, GELU MLP, biases; tiny / small / medium) or llama (RMSNorm, SwiGLU MLP
--mlp-hidden, grouped-query attention --kv-heads, no biases; examples/lm/lm_layers.py); --remat none|quantized|full
checkpoints every block (quantized: keep the quantized GEMM residuals). AdamW (warmup + cosine, global-norm
clipping) in one jitted train step. Data (examples/lm/lm_data.py): the Python standard library's .py files (no download;
split by file) or any --data FILE (split by contiguous region); byte tokens, or --tokenizer bpe --vocab N: a
byte-level BPE trained on the corpus with Hugging Face tokenizers (examples/lm/lm_tokenizer.py, cached under
--out/tokenizer). `--compare` trains every recipe from the same initial weights on the same batches in the same order.
--preset large: Llama-style, 1.01B parameters, seq 2048, BPE 32768, scanned blocks, remat quantized; large-350m: the
same at 0.34B.

--mesh DATAxTENSOR or DATAxFSDPxTENSOR (e.g. 2x1, 1x2, 1x2x1, 2x2x2; the product = the device count) runs the step on
a (data, fsdp, tensor) mesh (examples/lm/lm_mesh.py): the batch split over data x fsdp, every matrix and its AdamW
moments split over "fsdp", and Megatron-style tensor parallelism over "tensor" (qkv and MLP-up kernels split by
columns, attention-output and MLP-down kernels by rows, attention by heads). The jax_fp4 quantize primitives run per
shard with the tensor amaxes reduced across shards. Without --mesh: one device, as before. Checkpoints hold global
arrays: a run may resume on another mesh.

--moe [E] (default E = 8 when the flag is given alone) replaces every block's MLP by a `jax_fp4.flax.moe.MoEMLP`: a
bfloat16 router choosing --top-k K experts per token (default 2, dropless), each expert a GELU MLP as wide as the
dense one (mlp_ratio x d_model), its grouped GEMMs quantized by the recipe through `jax_fp4.ragged_dot` (nvfp4-1x64:
1D NVFP4 for the experts' token operand, grouped quantize has no 1x64 encode). The objective adds --aux-weight W
(default 0.01) x the Switch load-balancing loss (E * sum_e f_e P_e averaged over the blocks, 1 when balanced), which
is logged as aux_loss; train_loss / val_loss stay the cross-entropy. With --mesh: data parallel only (tensor 1).

Precision control (examples/lm/lm_precision.py): --bf16-first / --bf16-last N, --bf16-last-fraction F, --mxfp8-first /
--mxfp8-last N, --policy-mlp-only, --exclude PATTERN build a `jax_fp4.policy.Policy` (the layer -> recipe table is
printed; per-block rules split scanned blocks into segments, one scan each); --switch-at X [--switch-to R --switch-scope
fwd|all] switches the recipe at a step or fraction of training (one compiled step per phase over the same state;
checkpoints record the phase); --diagnostics N runs every N-th step as a diagnostics step (the same update) that also
returns per-layer, per-operand quantization statistics (diagnostics.csv, diagnostics_<run>.png heatmaps of SNR and
saturation); --seeds S ... repeats every configuration per seed and writes gaps.csv / gaps.json (each gap against bf16
of the same seed, mean and spread); --recipes a,b picks recipes; --stop-at STEP stops early (resume later). --preset
medium (85.5M parameters) trains on every .py under site-packages. The table reports MFU (model FLOPs / step time / the
device's dense bf16 peak, lm_precision.PEAK_BF16). Attention runs cuDNN's fused kernel on a GPU.

Writes to --out DIR: curves.csv (step, recipe, train_loss, val_loss, tokens_per_s; rows of recipes not run now are
kept), curves.png (the recipes' curves overlaid), summary.json, and checkpoints/<recipe>/ (Orbax: model, optimizer
and rng state, step; every --ckpt-every steps and at the end; --resume continues from the latest). Prints a table
of validation loss, bits per byte, the gap to bf16, tokens/s and step time; summary.json also records MFU, the compile
time (first step of each compiled program less a steady step), peak memory per device (None on the CPU), the
parameter count and, with --collectives, the compiled step's collectives.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp4 import recipes

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, also under python -P
import lm_checkpoint  # noqa: E402
import lm_data  # noqa: E402
import lm_layers  # noqa: E402
import lm_mesh  # noqa: E402
import lm_model  # noqa: E402
import lm_precision  # noqa: E402
import lm_report  # noqa: E402
import lm_tokenizer  # noqa: E402

PRESETS = {
    # tiny: two CPU cores, ~1 min per quantized recipe (mostly XLA compiling the bit-exact reference kernels)
    "tiny": dict(d_model=64, layers=2, head_dim=32, seq=64, batch=8, steps=80, lr=3e-3, warmup=10, eval_every=20,
                 eval_batches=4, log_every=5, ckpt_every=0, scan=False),
    # small: one H100 GPU; sized so that --compare (5 recipes x 2000 steps) stays within about 8 minutes
    "small": dict(d_model=384, layers=4, head_dim=64, seq=256, batch=32, steps=2000, lr=1e-3, warmup=100,
                  eval_every=250, eval_batches=8, log_every=25, ckpt_every=1000, scan=True),
    # medium: one GPU, 85.5M parameters (12 x 12 d_model^2 + embedding and head), 32k tokens per step on the
    # site-packages corpus (~65M tokens in 2000 steps, so the model does not run through its data many times).
    # Unscanned: on an H100 the scanned stack's per-layer slicing and gradient stacking cost ~30 ms of a ~48 ms
    # bf16 step; unrolled, XLA compiles 12 blocks (~15 s) once per recipe.
    "medium": dict(d_model=768, layers=12, head_dim=64, seq=512, batch=64, steps=2000, lr=6e-4, warmup=200,
                   eval_every=250, eval_batches=8, log_every=25, ckpt_every=1000, scan=False, corpus="site-packages"),
    # large: Llama-style (RMSNorm, SwiGLU, grouped-query attention, untied embeddings), ~1.0B parameters, seq 2048,
    # BPE tokens (32768, trained on the corpus), scanned blocks checkpointed keeping the quantized residuals; 32k
    # tokens per step, meant for an fsdp mesh (--mesh 1x2x1 on 2 GPUs).
    "large": dict(d_model=2048, layers=16, head_dim=128, kv_heads=4, mlp_hidden=7168, seq=2048, batch=16, steps=300,
                  lr=3e-4, warmup=100, eval_every=100, eval_batches=4, log_every=10, ckpt_every=0, scan=True,
                  corpus="site-packages", arch="llama", remat="quantized", tokenizer="bpe", vocab=32768),
    # large-350m: the large architecture at ~0.34B parameters (d_model 1024, 24 blocks), 1000 steps of 32k tokens.
    "large-350m": dict(d_model=1024, layers=24, head_dim=64, kv_heads=4, mlp_hidden=2816, seq=2048, batch=16,
                       steps=1000, lr=6e-4, warmup=100, eval_every=250, eval_batches=4, log_every=25, ckpt_every=0,
                       scan=True, corpus="site-packages", arch="llama", remat="quantized", tokenizer="bpe",
                       vocab=32768),
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
    mesh: tuple[int, int, int] | None = None  # (data, fsdp, tensor); None: one device

    def resume_key(self) -> dict:
        """What a checkpoint must agree on to be resumed (the rest, e.g. --steps or the mesh, may change). Fields
        added since older checkpoints are left out at their defaults (dense: the moe_ fields), so those resume."""
        default = lm_model.ModelConfig()
        model = {k: v for k, v in dataclasses.asdict(self.model).items()
                 if (self.model.moe or not k.startswith("moe_"))
                 and not (k in NEW_MODEL_FIELDS and v == getattr(default, k))}
        return {"model": model, "batch": self.batch, "lr": self.lr, "warmup": self.warmup, "seed": self.seed}


NEW_MODEL_FIELDS = ("arch", "kv_heads", "mlp_hidden", "remat", "vocab")


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
    """(data, fsdp, tensor) of "DATAxTENSOR" (fsdp 1) or "DATAxFSDPxTENSOR"."""
    parts = re.split(r"\s*[xX]\s*", s.strip())
    if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"{s!r} is not DATAxTENSOR or DATAxFSDPxTENSOR with positive sizes, e.g. "
                                         "2x1, 1x2, 2x4 or 1x2x1")
    sizes = [int(p) for p in parts]
    return (sizes[0], 1, sizes[1]) if len(sizes) == 2 else tuple(sizes)


def _nonnegative_float(s):
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {s}")
    return v


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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Presets: " + "; ".join(
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
    p.add_argument("--mesh", type=_mesh_shape, metavar="DATAx[FSDPx]TENSOR",
                   help="shard the step over a data x fsdp x tensor device mesh, e.g. 2x1 (data parallel), 1x2x1 "
                        "(fsdp), 1x2 (tensor "
                        "parallel), 2x4; the product must equal the device count (default: one device)")
    p.add_argument("--moe", type=_int_at_least(2), nargs="?", const=MOE_EXPERTS, metavar="E",
                   help=f"mixture-of-experts MLPs with E experts per block (default {MOE_EXPERTS} when given alone)")
    p.add_argument("--top-k", type=_int_at_least(1), help=f"with --moe: experts per token (default {MOE_TOP_K})")
    p.add_argument("--aux-weight", type=_nonnegative_float,
                   help=f"with --moe: weight of the load-balancing loss (default {MOE_AUX_WEIGHT}; 0: none)")
    p.add_argument("--seed", type=int, default=0, help="initialization and data-order seed (default 0)")
    p.add_argument("--data", type=_existing_file, help="train on this text file instead of the Python stdlib")
    p.add_argument("--corpus", choices=CORPORA, help="the embedded corpus: the stdlib's .py files, or every .py under "
                                                     "site-packages (default: the preset's, stdlib for tiny / small)")
    p.add_argument("--stop-at", type=_int_at_least(1), metavar="STEP",
                   help="stop after this step (checkpointing) of a --steps long run; continue later with --resume")
    p.add_argument("--out", type=Path, help="output directory (default runs/<preset>)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoints in --out")
    p.add_argument("--collectives", action="store_true",
                   help="record the collectives of the compiled step in summary.json (count and bytes per kind; "
                        "costs one more compile; loops counted once: use --no-scan for per-step totals)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    lm_precision.add_arguments(p)
    return p


def parse_args(argv=None):
    """(args, RunConfig, recipe names); bad flags exit through argparse with a message."""
    parser = make_parser()
    args = parser.parse_args(argv)
    v = dict(PRESETS[args.preset])
    for k in ("steps", "batch", "seq", "d_model", "layers", "lr", "warmup", "eval_every", "eval_batches", "log_every",
              "ckpt_every", "scan", "corpus", "arch", "kv_heads", "mlp_hidden", "remat", "tokenizer", "vocab"):
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
    for flag in ("top_k", "aux_weight"):
        if args.moe is None and getattr(args, flag) is not None:
            parser.error(f"--{flag.replace('_', '-')} needs --moe")
    moe = {} if args.moe is None else dict(
        moe_experts=args.moe, moe_top_k=MOE_TOP_K if args.top_k is None else args.top_k,
        moe_aux_weight=MOE_AUX_WEIGHT if args.aux_weight is None else args.aux_weight)
    if moe and not moe["moe_top_k"] <= moe["moe_experts"]:
        parser.error(f"--top-k {moe['moe_top_k']} exceeds the {moe['moe_experts']} experts of --moe")
    model = lm_model.ModelConfig(
        d_model=v["d_model"], n_layers=v["layers"], n_heads=args.heads or max(v["d_model"] // v["head_dim"], 1),
        seq=v["seq"], scan_layers=v["scan"], arch=v.get("arch", "gpt"), kv_heads=v.get("kv_heads", 0),
        mlp_hidden=v.get("mlp_hidden", 0), remat=v.get("remat", "none"),
        vocab=v.get("vocab", 32768) if args.tokenizer == "bpe" else lm_model.VOCAB, **moe)
    for problem in model.validate():
        parser.error(problem)
    if args.mesh is not None:
        shape = "x".join(map(str, args.mesh))
        for problem in lm_mesh.mesh_problems(model, v["batch"], *args.mesh):
            parser.error(f"--mesh {shape}: {problem}")
        devices, n = jax.devices(), math.prod(args.mesh)
        if n != len(devices):
            parser.error(f"--mesh {shape} needs data x fsdp x tensor = {n} devices; there are "
                         f"{len(devices)} ({devices[0].platform}): the product must equal the device count")
    cfg = RunConfig(model=model, batch=v["batch"], steps=v["steps"], lr=v["lr"], warmup=v["warmup"],
                    eval_every=v["eval_every"], eval_batches=v["eval_batches"], log_every=v["log_every"],
                    ckpt_every=v["ckpt_every"], seed=args.seed, mesh=args.mesh)
    args.out = args.out if args.out is not None else Path("runs") / args.preset
    names = (["bf16"] + sorted(n for n in recipes.RECIPES if n != "bf16") if args.compare else
             args.recipes if args.recipes else [args.recipe])
    runs = [lm_precision.run_name(n, args, seed) for seed in (args.seeds or [None]) for n in names]
    if args.resume and not any(lm_checkpoint.latest_step(args.out / "checkpoints" / n) is not None for n in runs):
        parser.error(f"--resume: no checkpoint of {', '.join(runs)} under {args.out / 'checkpoints'}")
    return args, cfg, names


# ---- training --------------------------------------------------------------------------------------------------------
def train_recipe(name: str, cfg: RunConfig, corpus: lm_data.Corpus, out: Path, resume: bool = False,
                 progress: bool = True, *, run: str | None = None, policy=None, switch=None, diagnostics: int = 0,
                 stop_at: int | None = None, collectives: bool = False):
    """Train one run of recipe `name`; returns (curve rows, summary dict, diagnostics rows). Checkpoints go to
    out/checkpoints/<run> (run: the run's name, default `name`).

    policy: a `jax_fp4.policy.Policy` with the recipe as default (None: every layer the recipe); switch: a
    `jax_fp4.schedule.PrecisionSwitch` (None: one phase): each phase is its own compiled step over the same state,
    chosen by the step number, so the run compiles again once at the switch. diagnostics N > 0: every N-th step runs
    the diagnostics step (the same update, also returning the per-layer quantization statistics). stop_at: stop after
    that step (a checkpoint is written there). collectives: summary["collectives"] = `lm_report.collective_bytes`
    of the first phase's compiled step."""
    from tqdm.auto import tqdm

    from jax_fp4 import diagnostics as qdiag
    from jax_fp4 import policy as qpolicy

    wall = time.perf_counter()
    run = name if run is None else run
    recipe = recipes.by_name(name)
    mesh = lm_mesh.make_mesh(*cfg.mesh) if cfg.mesh is not None else None
    for note in lm_mesh.mesh_notes(cfg.model, recipe, cfg.mesh[2]) if cfg.mesh is not None else []:
        print(f"note: {note}")
    if cfg.model.moe and lm_model.expert_recipe(recipe) != recipe:
        print(f"note: {name}: the experts' token operands use 1D NVFP4 (1x16 blocks, one tensor scale per expert "
              "group): grouped quantize has no 1x64 encode")
    policy = qpolicy.uniform(recipe) if policy is None else policy
    policies = (policy,) if switch is None or not recipe.quantized else switch.phases(policy)
    switch = switch if len(policies) > 1 else None
    ph = lm_model.build_phases(cfg.model, recipe, policies, lm_model.OptConfig(lr=cfg.lr, warmup=cfg.warmup,
                                                                                 steps=cfg.steps), cfg.seed, mesh)
    state = ph.state
    if policy.rules or switch is not None:
        for i, table in enumerate(ph.tables):
            what = "" if switch is None else (" before the switch" if i == 0 else f" after the switch ("
                                              f"{switch.describe(cfg.steps)})")
            print(f"{run}: layer recipes{what}:\n{table}")
    phase_of = (lambda step: 0) if switch is None else (lambda step: switch.phase(step, cfg.steps))  # noqa: E731
    switch_desc = None if switch is None else switch.describe(cfg.steps)
    tokens = cfg.batch * cfg.model.seq
    val = lm_data.val_batches(corpus, cfg.eval_batches, cfg.batch, cfg.model.seq)

    def evaluate(state, step):
        # The training step's loss is that of the parameters before its update: run it on a copy of the state (the
        # step donates its input) and drop the update. One compiled program per recipe instead of two (on the CPU a
        # separate forward program costs as much XLA compile time as the whole step).
        losses = [ph.steps[phase_of(step)](jax.tree.map(jnp.copy, state), b)[1]["loss"] for b in val]
        return float(np.mean([float(v) for v in losses]))

    hlo = None
    if collectives:  # the compiled step's collectives, before the state is donated to the first step
        batch0 = lm_data.train_batch(corpus, 0, cfg.batch, cfg.model.seq, cfg.seed)
        hlo = lm_report.collective_bytes(ph.steps[0].lower(state, batch0).compile().as_text())
    ckdir = out / "checkpoints" / run
    rows, start, timed, drows = [], 0, {"seconds": 0.0, "steps": 0, "diag_seconds": 0.0, "diag_steps": 0}, []
    if resume and lm_checkpoint.latest_step(ckdir) is not None:
        mgr = lm_checkpoint.checkpointer(ckdir)
        # the metadata first: another model's state would not restore
        meta = lm_checkpoint.restore_meta(mgr, mgr.latest_step())
        if meta["config"] != cfg.resume_key() or meta.get("switch") != switch_desc:
            flat = lambda d: {**{k: v for k, v in d.items() if k != "model"}, **d["model"]}  # noqa: E731
            old = {**flat(meta["config"]), "switch": meta.get("switch")}
            new = {**flat(cfg.resume_key()), "switch": switch_desc}
            diff = ", ".join(f"{k} {old.get(k)} (now {new.get(k)})" for k in dict.fromkeys([*new, *old])
                             if old.get(k) != new.get(k))
            mgr.close()
            raise SystemExit(f"--resume: {ckdir} was written with {diff}; use the same preset and overrides, or "
                             "another --out")
        state, meta = lm_checkpoint.restore_checkpoint(mgr, mgr.latest_step(), state)
        start, rows = meta["step"], meta["rows"]
        timed = {**timed, **{k: v for k, v in meta["timed"].items() if not k.startswith("first")}}  # this process
        drows = meta.get("diagnostics", [])
        print(f"{run}: resumed from {ckdir} at step {start} (phase {meta.get('phase', 0)})")
    else:
        shutil.rmtree(ckdir, ignore_errors=True)  # a fresh run replaces this run's old checkpoints
        mgr = lm_checkpoint.checkpointer(ckdir)

    stop = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    bar = tqdm(total=cfg.steps, initial=min(start, cfg.steps), desc=f"{run:>19}", unit="step", disable=not progress,
               dynamic_ncols=True, mininterval=0.5)
    moe = cfg.model.moe
    pending, interval, t0, compiled = [], 0, None, set()
    for step in range(start, stop):
        batch = lm_data.train_batch(corpus, step, cfg.batch, cfg.model.seq, cfg.seed)
        phase = phase_of(step)
        diag = bool(diagnostics) and (step + 1) % diagnostics == 0
        first = (phase, diag) not in compiled  # this step compiles: leave it out of the timings
        compiled.add((phase, diag))
        if diag or first:  # time it apart (diagnostics) or not at all (compile): close the running interval
            jax.block_until_ready(state)
            if t0 is not None:
                timed["seconds"] += time.perf_counter() - t0
                timed["steps"] += interval
            interval, td = 0, time.perf_counter()
        if diag:
            state, losses, stats = ph.diag_steps[phase](state, batch)
            drows += qdiag.rows(jax.device_get(stats), step=step + 1, run=run, phase=phase)
        else:
            state, losses = ph.steps[phase](state, batch)
        pending.append(losses)
        bar.update(1)
        if diag or first:
            jax.block_until_ready(state)
            if diag and not first:
                timed["diag_seconds"] += time.perf_counter() - td
                timed["diag_steps"] += 1
            if first:  # compile + one step (what compile_s subtracts the step time from)
                timed["first_seconds"] = timed.get("first_seconds", 0.0) + time.perf_counter() - td
                timed["first_steps"] = timed.get("first_steps", 0) + 1
            t0 = time.perf_counter()
        else:
            interval += 1
        done = step + 1 == cfg.steps
        log, ev = (step + 1) % cfg.log_every == 0 or done, (step + 1) % cfg.eval_every == 0 or done
        ckpt = done or step + 1 == stop or (cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0)
        if not (log or ev or ckpt):
            continue
        train_loss = float(np.mean([float(v["loss"]) for v in pending]))  # waits for the step
        aux_loss = float(np.mean([float(v["aux_loss"]) for v in pending])) if moe else None
        dt = time.perf_counter() - t0
        timed["seconds"] += dt
        timed["steps"] += interval
        row = {"step": step + 1, "recipe": run, "train_loss": train_loss,
               "val_loss": evaluate(state, step) if ev else None,
               "tokens_per_s": interval * tokens / dt if interval else None, "aux_loss": aux_loss, "phase": phase}
        rows.append(row)
        if not math.isfinite(train_loss) and all(map(math.isfinite, (r["train_loss"] for r in rows[:-1]))):
            bar.write(f"{run}: the training loss is {train_loss} at step {step + 1}")
        bar.set_postfix({"loss": f"{train_loss:.3f}", **({"val": f"{row['val_loss']:.3f}"} if ev else {}),
                         **({"aux": f"{aux_loss:.3f}"} if moe else {}),
                         **({"tok/s": f"{row['tokens_per_s']:,.0f}"} if interval else {})}, refresh=False)
        if ckpt:
            lm_checkpoint.save_checkpoint(mgr, step + 1, state,
                            {"step": step + 1, "recipe": name, "run": run, "config": cfg.resume_key(),
                             "switch": switch_desc, "phase": phase_of(step + 1) if step + 1 < cfg.steps else phase,
                             "phase_recipes": ph.tables[phase_of(step + 1) if step + 1 < cfg.steps else phase],
                             "rows": list(rows), "timed": dict(timed),
                             "diagnostics": list(drows)})  # copies: the save may finish in the background
        pending, interval, t0 = [], 0, time.perf_counter()  # evaluation and checkpointing are not timed
    bar.close()
    mgr.wait_until_finished()
    mgr.close()

    last_val = next((r["val_loss"] for r in reversed(rows) if r["val_loss"] is not None), None)
    if start >= cfg.steps:
        print(f"{run}: the checkpoint is at step {start} >= --steps {cfg.steps}; nothing to train")
    if last_val is None:
        last_val = evaluate(state, max(start, stop) - 1)
    step_s = timed["seconds"] / timed["steps"] if timed["steps"] else math.nan
    summary = {"recipe": run, "steps": max(start, stop), "val_loss": last_val,
               "bits_per_byte": last_val / math.log(2) / corpus.bytes_per_token, "tokens_per_s": tokens / step_s,
               "step_ms": 1e3 * step_s, "wall_s": time.perf_counter() - wall, "seed": cfg.seed}
    peak = lm_precision.peak_flops(jax.devices()[0].device_kind)
    n_dev = 1 if cfg.mesh is None else math.prod(cfg.mesh)
    summary["mfu"] = (lm_model.flops_per_token(cfg.model) * tokens / step_s / (peak * n_dev)
                      if peak and math.isfinite(step_s) else None)
    # compile time: the first step of each compiled program (this process) less one steady step
    firsts = timed.get("first_steps", 0)
    summary["compile_s"] = (timed["first_seconds"] - firsts * (step_s if math.isfinite(step_s) else 0.0)
                            if firsts else None)
    summary["peak_bytes_per_device"] = lm_report.peak_memory()  # None on the CPU
    summary.update(params=lm_model.count_params(cfg.model), devices=n_dev, device_kind=jax.devices()[0].device_kind,
                   mesh=None if cfg.mesh is None else dict(zip(lm_mesh.AXES, cfg.mesh, strict=True)),
                   tokens_per_step=tokens, flops_per_token=lm_model.flops_per_token(cfg.model))
    if hlo is not None:
        summary["collectives"] = hlo
    if timed["diag_steps"]:
        summary["diag_step_ms"] = 1e3 * timed["diag_seconds"] / timed["diag_steps"]
    if switch is not None:
        summary["switch"] = switch_desc
    if moe:  # the load-balancing loss of the last logged steps (1: balanced)
        summary["aux_loss"] = next((r["aux_loss"] for r in reversed(rows) if r.get("aux_loss") is not None), None)
    return rows, summary, drows


def main(argv=None) -> dict:
    """Run the CLI; returns {run name: summary} of the runs trained now."""
    from jax_fp4.policy import UnmatchedRuleError

    args, cfg, names = parse_args(argv)
    try:
        corpus = (lm_data.load_text_file(args.data) if args.data else
                  lm_data.load_site_packages() if args.corpus == "site-packages" else lm_data.load_stdlib())
        args.out.mkdir(parents=True, exist_ok=True)
        if args.tokenizer == "bpe":  # trained on this corpus, cached next to the run
            corpus = lm_tokenizer.tokenize_corpus(corpus, cfg.model.vocab, args.out / "tokenizer")
        lm_data.check_sizes(corpus, cfg.model.seq)
    except (OSError, ValueError) as e:
        make_parser().error(str(e))
    m = cfg.model
    print(f"data: {corpus.description}")
    print(f"model: {m.arch}, {lm_model.count_params(m) / 1e6:.2f}M parameters, d_model {m.d_model}, "
          f"{m.n_layers} block{'s' * (m.n_layers > 1)}{' (scanned)' if m.scan_layers else ''}, {m.n_heads} heads"
          f"{f' ({m.kv} kv)' if m.kv != m.n_heads else ''}, MLP {m.hidden}, vocab {m.vocab}, remat {m.remat}, "
          f"seq {m.seq}, batch {cfg.batch} ({cfg.batch * m.seq} tokens/step), {cfg.steps} steps, "
          f"{lm_model.flops_per_token(m) * cfg.batch * m.seq / 1e12:.2f} TFLOP/step; " + (
              f"device: {jax.devices()[0]} ({jax.devices()[0].device_kind})" if cfg.mesh is None else
              f"mesh: data {cfg.mesh[0]} x fsdp {cfg.mesh[1]} x tensor {cfg.mesh[2]} over {len(jax.devices())} "
              f"devices ({jax.devices()[0].device_kind})"))
    if m.moe:
        print(f"moe: every MLP {m.moe_experts} experts, top-{m.moe_top_k} per token (bfloat16 router, dropless), "
              f"expert hidden {m.mlp_ratio * m.d_model} (GELU), load-balancing loss weight {m.moe_aux_weight:g}; "
              f"{lm_model.count_params(m, active=True) / 1e6:.2f}M parameters active per token")

    rows, summaries, switch = [], {}, lm_precision.make_switch(args)
    for seed in args.seeds or [None]:
        run_cfg = cfg if seed is None else dataclasses.replace(cfg, seed=seed)
        for name in names:
            run = lm_precision.run_name(name, args, seed)
            recipe = recipes.by_name(name)
            policy = lm_precision.make_policy(args, recipe, m.n_layers) if recipe.quantized else None
            try:
                r, summaries[run], drows = train_recipe(
                    name, run_cfg, corpus, args.out, resume=args.resume, progress=not args.no_progress, run=run,
                    policy=policy, switch=switch, diagnostics=args.diagnostics, stop_at=args.stop_at,
                    collectives=args.collectives)
            except UnmatchedRuleError as e:
                make_parser().error(str(e))
            rows += r
            lm_precision.write_diagnostics(args.out, run, drows)
    runs = list(summaries)
    all_rows = lm_report.write_curves(args.out, rows, set(runs))
    path = args.out / "summary.json"
    merged = json.loads(path.read_text()) if path.is_file() else {}
    merged.update(summaries)
    path.write_text(json.dumps(merged, indent=1))
    tokens = "byte-level" if args.tokenizer == "bytes" else f"BPE {m.vocab}"
    lm_report.plot_curves(args.out, all_rows, f"{tokens} {m.arch}, d_model {m.d_model}, {m.n_layers} layers, seq "
                          f"{m.seq}, batch {cfg.batch}: {', '.join(dict.fromkeys(r['recipe'] for r in all_rows))}")
    table = dict(summaries)
    for seed in args.seeds or [None]:  # the reference of the gap: bf16 of an earlier run into this --out
        ref = "bf16" if seed is None else f"bf16@s{seed}"
        if ref not in table and ref in merged:
            table = {ref: merged[ref], **table}
    print()
    print(lm_report.format_table(table))
    for run, sm in summaries.items():  # what the table leaves out (summary.json has all of it)
        peak = sm.get("peak_bytes_per_device")
        print(f"{run}: compile {sm['compile_s'] or 0:.1f} s" + (
            f", peak memory per device {', '.join(f'{b / 2**30:.2f}' for b in peak)} GiB" if peak else ""))
    if args.seeds:
        gaps = lm_precision.seed_gaps(merged)
        lm_precision.write_gaps(args.out, gaps)
        print(f"\ngap to bf16 over seeds (each seed against bf16 of the same seed; {args.out / 'gaps.csv'}):")
        print(lm_precision.format_gaps(gaps))
    print(f"\ncurves: {args.out / 'curves.csv'}, {args.out / 'curves.png'}; checkpoints: {args.out / 'checkpoints'}"
          + (f"; diagnostics: {args.out / 'diagnostics.csv'}, {args.out / 'diagnostics.png'}" if args.diagnostics
             else ""))
    return summaries


if __name__ == "__main__":
    main()
