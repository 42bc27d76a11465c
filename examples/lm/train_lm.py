"""Train a GPT- or Llama-style decoder whose attention projections and MLPs run through jax_fp4's quantized layers.

    python examples/lm/train_lm.py --compare --preset tiny --out runs/tiny          # every recipe, CPU: a few minutes
    python examples/lm/train_lm.py --recipe nvfp4 --preset small --steps 2000       # one recipe, one GPU
    python examples/lm/train_lm.py --recipe mxfp8 --data book.txt --resume --out runs/book
    python examples/lm/train_lm.py --compare --preset small --mesh 2x1      # 2 GPUs, data parallel (1x2: tensor)
    python examples/lm/train_lm.py --compare --moe 8 --top-k 2              # mixture-of-experts MLPs (8 experts, top-2)
    python examples/lm/train_lm.py --recipes bf16,nvfp4-fwd-mxfp8-bwd --preset large --mesh 1x2x1    # ~1B, 2 GPUs, fsdp

Presets, flags and their checks: examples/lm/lm_config.py. The model (examples/lm/lm_model.py): a pre-norm decoder
with rotary positions; qkv, the attention output projection and the MLP are `jax_fp4.flax.nnx` layers following the
recipe, the embedding, norms, attention scores and logits head stay bfloat16. --arch gpt (LayerNorm, GELU MLP, biases;
tiny / small / medium) or llama (RMSNorm, SwiGLU MLP --mlp-hidden, grouped-query attention --kv-heads, no biases;
examples/lm/lm_layers.py); --remat none|quantized|full checkpoints every block (quantized: keep the quantized GEMM
residuals). AdamW (warmup + cosine, global-norm clipping) in one jitted train step. Data (examples/lm/lm_data.py): the
Python standard library's .py files (no download; split by file) or any --data FILE (split by contiguous region); byte
tokens, or --tokenizer bpe --vocab N: a byte-level BPE trained on the corpus with Hugging Face tokenizers
(examples/lm/lm_tokenizer.py, cached under --out/tokenizer). `--compare` trains every recipe from the same initial
weights on the same batches in the same order. --preset large: Llama-style, 1.01B parameters, seq 2048, BPE 32768,
scanned blocks, remat quantized; large-350m: the same at 0.34B.

--mesh DATAxTENSOR or DATAxFSDPxTENSOR (e.g. 2x1, 1x2, 1x2x1, 2x2x2; the product = the device count) runs the step on
a (data, fsdp, tensor) mesh (examples/lm/lm_mesh.py): the batch split over data x fsdp, every matrix and its AdamW
moments split over "fsdp", and Megatron-style tensor parallelism over "tensor" (qkv and MLP-up kernels split by
columns, attention-output and MLP-down kernels by rows, attention by heads). The jax_fp4 quantize primitives run per
shard with the tensor amaxes reduced across shards. With fsdp > 1 every quantized layer's recipe becomes
`jax_fp4.distributed.shard_recipe(recipe, fsdp_axes="fsdp", reduce_dtype=R)`: each device quantizes its slice of the
weight and the codes and block scales are all-gathered (bf16 layers and recipes are left to XLA); --fsdp-reduce R:
float32 (default: partial GEMM products summed in float32, the unsharded bits) or output (summed in bfloat16). Without
--mesh: one device. Checkpoints hold global arrays: a run may resume on another mesh.

Several processes (one per GPU or host; examples/lm/lm_distributed.py): --distributed (jax.distributed.initialize()
detecting SLURM / Open MPI / Kubernetes) or --coordinator HOST:PORT --num-processes N --process-id I; the --mesh spans
every process's devices. Each process reads only its rows of every global batch (the batches of a one-process run);
process 0 alone prints and writes the files below; all write the checkpoints (--out: a directory all reach).

--moe [E] (default E = 8 when the flag is given alone) replaces every block's MLP by a `jax_fp4.flax.moe.MoEMLP`: a
bfloat16 router choosing --top-k K experts per token (default 2, dropless), each expert a GELU MLP as wide as the
dense one (mlp_ratio x d_model), its grouped GEMMs quantized by the recipe through `jax_fp4.ragged_dot` (nvfp4-1x64:
1D NVFP4 for the experts' token operand, grouped quantize has no 1x64 encode). The objective adds --aux-weight W
(default 0.01) x the Switch load-balancing loss (E * sum_e f_e P_e averaged over the blocks, 1 when balanced), which
is logged as aux_loss (summary.json: also expert_load, the per-expert fraction of the assignments); train_loss /
val_loss stay the cross-entropy. llama blocks: SwiGLU experts of width --mlp-hidden (--preset moe-large: 64 experts,
top-8). --mesh DATAxFSDPxTENSORxEXPERT splits the experts over the expert axis (`jax_fp4.flax.moe_ep`: all-to-all
dispatch, quantized for quantized recipes; --capacity-factor bounds the buffers); no tensor axis with --moe.

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
time (first step of each compiled program less a steady step), peak memory per device (process 0's devices; None on
the CPU), the parameter count, the process count and, with --collectives, the compiled step's collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp4 import determinism, recipes

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, also under python -P
import lm_checkpoint  # noqa: E402
import lm_collectives  # noqa: E402
import lm_data  # noqa: E402
import lm_distributed  # noqa: E402
import lm_mesh  # noqa: E402
import lm_model  # noqa: E402
import lm_precision  # noqa: E402
import lm_report  # noqa: E402
import lm_stats  # noqa: E402
import lm_tokenizer  # noqa: E402
from lm_config import RunConfig, make_parser, parse_args  # noqa: E402


def train_recipe(name: str, cfg: RunConfig, corpus: lm_data.Corpus, out: Path, resume: bool = False,
                 progress: bool = True, *, run: str | None = None, policy=None, switch=None, diagnostics: int = 0,
                 stop_at: int | None = None, collectives: bool = False):
    """Train one run of recipe `name`; returns (curve rows, summary dict, diagnostics rows). Checkpoints go to
    out/checkpoints/<run> (run: the run's name, default `name`).

    policy: a `jax_fp4.policy.Policy` with the recipe as default (None: every layer the recipe); switch: a
    `jax_fp4.schedule.PrecisionSwitch` (None: one phase): each phase is its own compiled step over the same state,
    chosen by the step number, so the run compiles again once at the switch. diagnostics N > 0: every N-th step runs
    the diagnostics step (the same update, also returning the per-layer quantization statistics). stop_at: stop after
    that step (a checkpoint is written there). collectives: summary["collectives"] = `lm_collectives.collective_bytes`
    of the first phase's compiled step."""
    from flax import nnx
    from tqdm.auto import tqdm

    from jax_fp4 import policy as qpolicy

    wall = time.perf_counter()
    peak_before = lm_report.peak_memory()  # the process's peak so far (an earlier run's)
    run = name if run is None else run
    recipe = recipes.by_name(name)
    mesh = lm_mesh.make_mesh(*cfg.mesh) if cfg.mesh is not None else None
    for note in lm_mesh.mesh_notes(cfg.model, recipe, cfg.mesh[2]) if cfg.mesh is not None else []:
        print(f"note: {note}")
    if lm_mesh.layer_recipe(recipe, mesh) is not recipe:
        print(f"note: {name}: the quantized layers gather their weights' codes and block scales over fsdp "
              f"(jax_fp4.distributed.shard_recipe, reduce_dtype {cfg.fsdp_reduce})")
    if cfg.model.moe and lm_model.expert_recipe(recipe) != recipe:
        print(f"note: {name}: the experts' token operands use 1D NVFP4 (1x16 blocks, one tensor scale per expert "
              "group): grouped quantize has no 1x64 encode")
    policy = qpolicy.uniform(recipe) if policy is None else policy
    policies = (policy,) if switch is None or not recipe.quantized else switch.phases(policy)
    switch = switch if len(policies) > 1 else None
    ph = lm_model.build_phases(cfg.model, recipe, policies, lm_model.OptConfig(lr=cfg.lr, warmup=cfg.warmup,
                                                                                 steps=cfg.steps), cfg.seed, mesh,
                               cfg.fsdp_reduce, deterministic=cfg.deterministic)
    state = ph.state
    if policy.rules or switch is not None:
        for i, table in enumerate(ph.tables):
            what = "" if switch is None else (" before the switch" if i == 0 else f" after the switch ("
                                              f"{switch.describe(cfg.steps)})")
            print(f"{run}: layer recipes{what}:\n{table}")
    phase_of = (lambda step: 0) if switch is None else (lambda step: switch.phase(step, cfg.steps))  # noqa: E731
    switch_desc = None if switch is None else switch.describe(cfg.steps)
    tokens = cfg.batch * cfg.model.seq
    # the global batches; this process reads only the rows its devices hold (lm_distributed)
    rows_of = lm_distributed.batch_rows(mesh, cfg.batch, cfg.model.seq)
    glob = lambda local: lm_distributed.global_batch(local, mesh, cfg.batch, cfg.model.seq)  # noqa: E731
    train_batch = lambda step: glob(lm_data.train_batch(corpus, step, cfg.batch, cfg.model.seq, cfg.seed,  # noqa
                                                        rows_of))
    val = [glob(b) for b in lm_data.val_batches(corpus, cfg.eval_batches, cfg.batch, cfg.model.seq, rows_of)]
    final_val = [glob(b) for b in lm_data.val_batches(corpus, cfg.final_eval_batches, cfg.batch, cfg.model.seq,
                                                      rows_of)]
    if corpus.val.size < cfg.final_eval_batches * cfg.batch * (cfg.model.seq + 1):
        print(f"note: the validation split holds {corpus.val.size:,} tokens, fewer than the last evaluation's "
              f"{cfg.final_eval_batches * cfg.batch * cfg.model.seq:,}: its windows overlap (lower --val-tokens)")

    def evaluate(state, step, batches=val):
        # The training step's loss is that of the parameters before its update: run it on a copy of the state (the
        # step donates its input) and drop the update. One compiled program per recipe instead of two (on the CPU a
        # separate forward program costs as much XLA compile time as the whole step). Returns the per-sequence
        # losses; their mean is the validation loss (every sequence has seq tokens).
        losses = [ph.steps[phase_of(step)](jax.tree.map(jnp.copy, state), b)[1]["seq_loss"] for b in batches]
        return np.concatenate([np.asarray(v, np.float64) for v in losses])

    hlo = None
    if collectives:  # the compiled step's collectives, before the state is donated to the first step
        batch0 = train_batch(0)
        tc = time.perf_counter()  # this compile is the step's (jax reuses it): its time goes to compile_s
        hlo = lm_collectives.collective_bytes(ph.steps[0].lower(state, batch0).compile().as_text())
        hlo_compile_s = time.perf_counter() - tc
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
        if lm_distributed.is_primary():  # a fresh run replaces this run's old checkpoints
            shutil.rmtree(ckdir, ignore_errors=True)
        lm_distributed.barrier("fresh checkpoints")  # every process writes its shards there
        mgr = lm_checkpoint.checkpointer(ckdir)

    stop = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    bar = tqdm(total=cfg.steps, initial=min(start, cfg.steps), desc=f"{run:>19}", unit="step", disable=not progress,
               dynamic_ncols=True, mininterval=0.5)
    moe = cfg.model.moe
    pending, interval, t0, compiled, load = [], 0, None, set(), None
    for step in range(start, stop):
        batch = train_batch(step)
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
            drows += lm_report.diagnostic_rows(jax.device_get(stats), step=step + 1, run=run, phase=phase)
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
        load = np.mean([np.asarray(v["expert_load"]) for v in pending], axis=0).tolist() if moe else load
        dt = time.perf_counter() - t0
        timed["seconds"] += dt
        timed["steps"] += interval
        if ev:  # the last evaluation of the run uses the final validation set (cfg.final_eval_batches)
            seq_losses = evaluate(state, step, final_val if done else val)
        row = {"step": step + 1, "recipe": run, "train_loss": train_loss,
               "val_loss": float(seq_losses.mean()) if ev else None,
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

    if start >= cfg.steps:
        print(f"{run}: the checkpoint is at step {start} >= --steps {cfg.steps}; nothing to train")
    if not (stop == cfg.steps and start < stop):  # stopped early or resumed at the end: evaluate the state as it is
        seq_losses = evaluate(state, max(start, stop) - 1, final_val)
    last_val = float(seq_losses.mean())
    step_s = timed["seconds"] / timed["steps"] if timed["steps"] else math.nan
    summary = {"recipe": run, "steps": max(start, stop), "val_loss": last_val,
               "bits_per_byte": last_val / math.log(2) / corpus.bytes_per_token, "tokens_per_s": tokens / step_s,
               "step_ms": 1e3 * step_s, "wall_s": time.perf_counter() - wall, "seed": cfg.seed}
    # the validation loss's own noise: its standard error over the final validation set's sequences, and the
    # per-sequence losses themselves (lm_precision pairs them across runs for the evaluation noise of a gap)
    summary.update(val_tokens=int(seq_losses.size * cfg.model.seq), val_loss_se=lm_stats.standard_error(
        seq_losses), val_seq_losses=[round(float(v), 6) for v in seq_losses], deterministic=cfg.deterministic)
    if cfg.deterministic:  # two deterministic runs of one configuration end with the same parameter bits
        # parameters and rng streams, gathered from every process
        summary["model_sha256"] = determinism.checksum(lm_distributed.host_tree(nnx.to_pure_dict(state)[0]))
    peak = lm_precision.peak_flops(jax.devices()[0].device_kind)
    n_dev = 1 if cfg.mesh is None else math.prod(cfg.mesh)
    summary["mfu"] = (lm_model.flops_per_token(cfg.model) * tokens / step_s / (peak * n_dev)
                      if peak and math.isfinite(step_s) else None)
    # compile time: the first step of each compiled program (this process) less one steady step
    firsts = timed.get("first_steps", 0)
    summary["compile_s"] = (timed["first_seconds"] - firsts * (step_s if math.isfinite(step_s) else 0.0)
                            if firsts else None)
    summary["peak_bytes_per_device"] = lm_report.peak_memory()  # None on the CPU
    if lm_report.peak_of_earlier_run(peak_before, summary["peak_bytes_per_device"]):
        summary["peak_set_by_earlier_run"] = True  # this run's peak is at most that figure
    summary.update(params=lm_model.count_params(cfg.model), devices=n_dev, processes=jax.process_count(),
                   device_kind=jax.devices()[0].device_kind,
                   mesh=None if cfg.mesh is None else dict(zip(lm_mesh.AXES, cfg.mesh, strict=True)),
                   tokens_per_step=tokens, flops_per_token=lm_model.flops_per_token(cfg.model))
    if hlo is not None:
        summary["collectives"] = hlo
        summary["compile_s"] = (summary["compile_s"] or 0.0) + hlo_compile_s
    if timed["diag_steps"]:
        summary["diag_step_ms"] = 1e3 * timed["diag_seconds"] / timed["diag_steps"]
    if switch is not None:
        summary["switch"] = switch_desc
    if moe:  # the load-balancing loss of the last logged steps (1: balanced), the per-expert load (blocks' mean)
        summary["aux_loss"] = next((r["aux_loss"] for r in reversed(rows) if r.get("aux_loss") is not None), None)
        summary["expert_load"] = load
    return rows, summary, drows


def main(argv=None) -> dict:
    """Run the CLI; returns {run name: summary} of the runs trained now. In a multi-process run (--distributed or
    --coordinator, lm_distributed) every process runs it; only process 0 prints and writes the run's files."""
    lm_distributed.initialize(argv)  # before any JAX computation: what jax.devices() lists
    args, cfg, names = parse_args(argv)
    for problem in lm_distributed.mesh_problems(cfg.mesh, cfg.batch, cfg.model.seq):
        make_parser().error(problem)
    if lm_distributed.is_primary():
        return _main(args, cfg, names)
    args.no_progress = True
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        return _main(args, cfg, names)


def load_corpus(args, cfg: RunConfig) -> lm_data.Corpus:
    """The run's corpus (tokenized with --tokenizer bpe), the same in every process: the byte corpora's digests, the
    tokenizer cache keys and the token ids are compared across the processes (SystemExit when they differ). --out
    must be one directory for all processes (checked); process 0 trains the BPE first, the others then load it from
    the cache.

    Raises:
      OSError, ValueError: no corpus, or splits too small for one window.
    """
    corpus = (lm_data.load_text_file(args.data) if args.data else
              lm_data.load_site_packages() if args.corpus == "site-packages" else lm_data.load_stdlib())
    args.out.mkdir(parents=True, exist_ok=True)
    lm_distributed.check_shared_dir(args.out)
    same = ("give every process the same --data file (or --corpus on the same Python and packages)"
            + (" and the same tokenizers version" if args.tokenizer == "bpe" else ""))
    if args.tokenizer == "bpe":  # trained on this corpus, cached next to the run
        key = lm_tokenizer.cache_key(corpus, cfg.model.vocab, lm_tokenizer.TRAIN_BYTES)
        lm_distributed.check_same(f"bpe-{cfg.model.vocab}-{key}", "the tokenizer cache keys", same)
        raw, cache = corpus, args.out / "tokenizer"
        if lm_distributed.is_primary():
            corpus = lm_tokenizer.tokenize_corpus(raw, cfg.model.vocab, cache)
        lm_distributed.barrier("tokenizer")
        if not lm_distributed.is_primary():  # loads what process 0 cached
            corpus = lm_tokenizer.tokenize_corpus(raw, cfg.model.vocab, cache)
        lm_distributed.check_same(lm_distributed.digest(corpus.train, corpus.val), "the token ids of the corpus",
                                  f"delete {args.out / 'tokenizer'} (a cache another run wrote) and start again")
    else:
        lm_distributed.check_same(lm_distributed.digest(corpus.train, corpus.val), "the corpora", same)
    lm_data.check_sizes(corpus, cfg.model.seq)
    return corpus


def _main(args, cfg: RunConfig, names: list[str]) -> dict:
    from jax_fp4.policy import UnmatchedRuleError

    try:
        corpus = load_corpus(args, cfg)
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
              f"mesh: data {cfg.mesh[0]} x fsdp {cfg.mesh[1]} x tensor {cfg.mesh[2]}"
              f"{f' x expert {cfg.mesh[3]}' if cfg.mesh[3] > 1 else ''} over {len(jax.devices())} "
              f"devices ({jax.devices()[0].device_kind})"))
    if m.moe:
        print(f"moe: every MLP {m.moe_experts} experts, top-{m.moe_top_k} per token (bfloat16 router, "
              f"{f'capacity factor {m.moe_capacity:g}' if m.moe_capacity else 'dropless'}), expert hidden {m.hidden} "
              f"({'SwiGLU' if m.arch == 'llama' else 'GELU'}, GEMMs by {m.moe_gemm}), load-balancing loss weight "
              f"{m.moe_aux_weight:g}; "
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
            if lm_distributed.is_primary():
                lm_report.write_diagnostics(args.out, run, drows)
    if not lm_distributed.is_primary():  # the run's files and table: process 0's
        return summaries
    runs = list(summaries)
    all_rows = lm_report.write_curves(args.out, rows, set(runs))
    path = args.out / "summary.json"
    merged = json.loads(path.read_text()) if path.is_file() else {}
    merged.update(summaries)
    path.write_text(json.dumps(merged, indent=1))
    tokens = "byte-level" if args.tokenizer == "bytes" else f"BPE {m.vocab}"
    lm_report.plot_curves(args.out, all_rows, f"{tokens} {m.arch}, d_model {m.d_model}, {m.n_layers} layers, seq "
                          f"{m.seq}, batch {cfg.batch}: {', '.join(dict.fromkeys(r['recipe'] for r in all_rows))}",
                          unit="byte" if args.tokenizer == "bytes" else "token")
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
            f", peak memory per device {', '.join(f'{b / 2**30:.2f}' for b in peak)} GiB" if peak else "") + (
            " (an earlier run's in this process; this run's is at most that)" if sm.get("peak_set_by_earlier_run")
            else ""))
    if args.seeds:
        gaps = lm_stats.seed_gaps(merged)
        lm_stats.write_gaps(args.out, gaps)
        lm_stats.plot_gaps(args.out, gaps, f"{args.preset}: {m.arch}, d_model {m.d_model}, {m.n_layers} layers")
        print(f"\ngap to bf16 over seeds (each seed against bf16 of the same seed; {args.out / 'gaps.csv'}):")
        print(lm_stats.format_gaps(gaps))
    print(f"\ncurves: {args.out / 'curves.csv'}, {args.out / 'curves.png'}; checkpoints: {args.out / 'checkpoints'}"
          + (f"; diagnostics: {args.out / 'diagnostics.csv'}, {args.out / 'diagnostics.png'}" if args.diagnostics
             else ""))
    return summaries


if __name__ == "__main__":
    main()
