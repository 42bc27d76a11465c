"""Probe for the XLA crash of scanned expert-parallel MoE layers with quantized recipes (jaxlib 0.11.2).

`examples/lm/train_lm.py --preset moe-large --mesh 1x1x1x2` ended with a segmentation fault in its first step when the
blocks were scanned and the recipe quantized: Shardy crashed on zero-size shard_map operands (CPU and GPU, every size;
`tools/dev/shardy_zero_size_repro.py`), fixed in jax_fp4 (`jax_fp4._src.primitives._common.empty_operand`). This
script reproduces the structure without the rest of the model: a stack of N `jax_fp4.flax.moe_ep.ExpertParallelMoEMLP`
layers on a (data=1, expert=2) mesh, residual blocks x + moe(x), a loss sum(x_N^2) + sum of the load-balancing
losses, forward and backward under one `jax.jit` over the functional state (as `lm_model.make_train_step`). The layers
are built and applied as `examples/lm/lm_model.py` does: stacked with `nnx.split_rngs` + `nnx.vmap` (the layer axis
unsharded), then either applied with `nnx.scan` (one while loop; with remat, `nnx.remat` inside the scanned body) or
taken apart into N layers with the same weights and applied in a Python loop (unrolled).

Each variant runs in its own process (`python -P this_file --one NAME`), because a segmentation fault ends the
process: the driver records the return code (negative: killed by that signal; -11 SIGSEGV), the wall time, the last
stage marker the child printed ("stage: build", "lower", "compile", "run", "steps": where it stopped) and the tail of
its stderr (the child enables `faulthandler`, so a crash leaves the Python stack there), prints one row per variant and
writes every record as JSON (--out).

Variant names: ``<recipe>-<layout>[-<option>...]``, recipe a `jax_fp4.recipes.by_name` name, layout "scan" or
"unroll", options:
  qdispatch     quantized_dispatch=True (the tokens and dy cross the all-to-all as quantized operands:
                `jax_fp4.expert_dispatch`); bf16dispatch: False; neither: None (the recipe decides, as train_lm).
  remat         `nnx.remat` of every block saving nothing (train_lm --remat full); rematq: saving the quantized GEMM
                residuals and the all-to-all outputs (train_lm --remat quantized).
  nocmdbuf      XLA_FLAGS += --xla_gpu_enable_command_buffer= (no CUDA graphs of XLA:GPU).
  refkernels    jax_fp4's compiled extensions are not imported, so its quantize / dequantize / GEMM primitives lower
                to the pure-JAX reference (no jax_fp4 FFI custom calls in the program; same values, slower).
  tokamax       the expert GEMMs through tokamax (implementation="tokamax") instead of "xla".

The default list separates the hypotheses (each row against the one above it that differs in one thing):
  bf16-scan                                          control: scanned, unquantized (trains on the GPU)
  nvfp4-fwd-mxfp8-bwd-unroll-qdispatch               control: quantized, unrolled (trains on the GPU)
  nvfp4-fwd-mxfp8-bwd-scan-bf16dispatch              a crash here: not the quantized all-to-all dispatch
  nvfp4-fwd-mxfp8-bwd-scan-qdispatch                 the harness's configuration (expected to crash)
  nvfp4-fwd-mxfp8-bwd-scan-qdispatch-nocmdbuf        passes: XLA:GPU command buffers capturing the while body
  nvfp4-fwd-mxfp8-bwd-scan-qdispatch-refkernels      passes: jax_fp4's FFI custom calls inside the while body
  mxfp8-scan-bf16dispatch                            the other quantized recipe, without the quantized dispatch
  nvfp4-fwd-mxfp8-bwd-scan-qdispatch-remat           the checkpointed body (remat inside the scan)

Run on a machine with 2 GPUs (jax_fp4 importable, e.g. PYTHONPATH=/tmp/site after tools/dev/moe_measure.sh's build):
  python3 -P tools/dev/ep_scan_probe.py --out $OUT/ep_scan_probe.json
On a CPU (forced host devices; tiny sizes):
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 python3 -P tools/dev/ep_scan_probe.py \\
      --d-model 64 --hidden 64 --experts 8 --top-k 2 --tokens 64 --seq 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

LAYOUTS = ("scan", "unroll")
OPTIONS = ("qdispatch", "bf16dispatch", "remat", "rematq", "nocmdbuf", "refkernels", "tokamax")
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="
DEFAULT_VARIANTS = (
    "bf16-scan",
    "nvfp4-fwd-mxfp8-bwd-unroll-qdispatch",
    "nvfp4-fwd-mxfp8-bwd-scan-bf16dispatch",
    "nvfp4-fwd-mxfp8-bwd-scan-qdispatch",
    "nvfp4-fwd-mxfp8-bwd-scan-qdispatch-nocmdbuf",
    "nvfp4-fwd-mxfp8-bwd-scan-qdispatch-refkernels",
    "mxfp8-scan-bf16dispatch",
    "nvfp4-fwd-mxfp8-bwd-scan-qdispatch-remat",
)
STAGE, RESULT = "stage: ", "RESULT "


@dataclasses.dataclass(frozen=True)
class Variant:
    """One configuration of the probe (see the module docstring for the name grammar)."""

    name: str
    recipe: str
    scan: bool
    quantized_dispatch: bool | None = None
    remat: str = "none"  # "none", "full" (nothing saved) or "quantized" (train_lm's --remat quantized)
    implementation: str = "xla"
    kernels: str = "ffi"  # "ffi": jax_fp4's compiled extensions; "reference": the pure-JAX lowerings
    xla_flags: str = ""  # appended to XLA_FLAGS in the variant's process

    def fields(self) -> dict:
        return dataclasses.asdict(self)


def parse_variant(name: str) -> Variant:
    """The Variant of a name ``<recipe>-<layout>[-<option>...]``; ValueError for a name outside that grammar."""
    parts = name.split("-")
    at = next((i for i, p in enumerate(parts) if p in LAYOUTS), None)
    if not at:
        raise ValueError(f"variant {name!r}: expected <recipe>-<layout>[-<option>...], layout one of {LAYOUTS}")
    options = parts[at + 1:]
    unknown = [o for o in options if o not in OPTIONS]
    if unknown or len(set(options)) != len(options):
        raise ValueError(f"variant {name!r}: options must be distinct ones of {OPTIONS}, got {options}")
    if {"qdispatch", "bf16dispatch"} <= set(options) or {"remat", "rematq"} <= set(options):
        raise ValueError(f"variant {name!r}: contradictory options {options}")
    dispatch = True if "qdispatch" in options else False if "bf16dispatch" in options else None
    remat = "full" if "remat" in options else "quantized" if "rematq" in options else "none"
    return Variant(name=name, recipe="-".join(parts[:at]), scan=parts[at] == "scan", quantized_dispatch=dispatch,
                   remat=remat, implementation="tokamax" if "tokamax" in options else "xla",
                   kernels="reference" if "refkernels" in options else "ffi",
                   xla_flags=NO_COMMAND_BUFFERS if "nocmdbuf" in options else "")


# --------------------------------------------------------------------------------------------------------------------
# One variant, in this process (--one NAME).


def stage(name: str) -> None:
    print(f"{STAGE}{name}", flush=True)


def run_one(variant: Variant, args) -> dict:
    """Build, compile and run the variant's step; the RESULT record (loss, gradient norm, timings, HLO counts)."""
    import faulthandler
    import warnings

    faulthandler.enable()
    if variant.kernels == "reference":
        # None in sys.modules makes the import fail, so jax_fp4 registers no FFI target and its primitives lower to
        # the pure-JAX reference on every platform.
        sys.modules["jax_fp4._jax_fp4_cuda"] = None
        sys.modules["jax_fp4._jax_fp4_cpu"] = None
        warnings.filterwarnings("ignore", message="jax_fp4: ")
    stage("import")
    import jax
    import jax.numpy as jnp
    import jaxlib
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_fp4 import recipes
    from jax_fp4._src import ffi
    from jax_fp4.dense import RESIDUAL_NAMES
    from jax_fp4.expert_parallel import SAVE_NAME
    from jax_fp4.flax.moe_ep import ExpertParallelMoEMLP

    def weights_digest(state):
        """sha256 of the parameters as one [N, ...] stack per leaf (the same for a scanned and an unrolled model
        built from the same seed)."""
        import hashlib

        pure = nnx.to_pure_dict(nnx.filter_state(state, nnx.Param))
        tree = pure["stack"] if variant.scan else jax.tree.map(
            lambda *v: np.stack([np.asarray(a) for a in v]), *(pure["layers"][i] for i in range(args.layers)))
        h = hashlib.sha256()
        for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(tree), key=lambda p: jax.tree_util.keystr(p[0])):
            h.update(jax.tree_util.keystr(path).encode())
            h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
        return h.hexdigest()

    backend = jax.default_backend()
    n_dev = args.data * args.expert
    if len(jax.devices()) < n_dev:
        raise SystemExit(f"ep_scan_probe: the mesh {args.data}x{args.expert} needs {n_dev} devices, {backend} has "
                         f"{len(jax.devices())} (on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count={n_dev})")
    if args.tokens % args.seq or (args.tokens // args.seq) % n_dev:
        raise SystemExit(f"ep_scan_probe: --tokens {args.tokens} must be --seq {args.seq} times a multiple of {n_dev}")
    mesh = jax.make_mesh((args.data, args.expert), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:n_dev])
    recipe = recipes.by_name(variant.recipe)
    layer_axis = {nnx.PARTITION_NAME: None}  # the stacked layer axis: unsharded (as lm_model._LAYER_AXIS)
    policy = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
              "quantized": jax.checkpoint_policies.save_only_these_names(*RESIDUAL_NAMES, SAVE_NAME)}[variant.remat]

    def layer(rngs):
        return ExpertParallelMoEMLP(args.d_model, args.hidden, args.experts, mesh=mesh, expert_axis="expert",
                                    batch_axes=("data", "expert"), quantized_dispatch=variant.quantized_dispatch,
                                    recipe=recipe, top_k=args.top_k, activation="swiglu", norm="rmsnorm",
                                    dtype=jnp.bfloat16, implementation=variant.implementation, rngs=rngs)

    def block(mlp, x):  # a residual block: (x + moe(x), the load-balancing loss)
        y, aux = mlp(x, return_aux_loss=True)
        return x + y, aux

    call = block if policy is None else nnx.remat(block, policy=policy)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0), transform_metadata=layer_axis)
    def scanned(x, mlp):
        return call(mlp, x)

    class Stack(nnx.Module):
        """N layers: stacked [N, ...] and scanned, or N separate layers applied in a loop (the same weights)."""

        def __init__(self, rngs):
            @nnx.split_rngs(splits=args.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=layer_axis)
            def stacked(rngs):
                return layer(rngs)

            stack = stacked(rngs)
            if variant.scan:
                self.stack = stack
            else:
                one = nnx.eval_shape(lambda: layer(nnx.Rngs(params=0, quantize=0)))
                graphdef, _ = nnx.split(one)
                pure = nnx.to_pure_dict(nnx.state(stack))
                layers = []
                for i in range(args.layers):
                    _, state = nnx.split(one)
                    nnx.replace_by_pure_dict(state, jax.tree.map(lambda v, i=i: v[i], pure))
                    layers.append(nnx.merge(graphdef, state))
                self.layers = nnx.List(layers)

        def __call__(self, x):
            if variant.scan:
                x, aux = scanned(x, self.stack)
                return x, jnp.sum(aux)
            total = jnp.zeros((), jnp.float32)
            for mlp in self.layers:
                x, aux = call(mlp, x)
                total = total + aux
            return x, total

    stage("build")
    model = Stack(nnx.Rngs(params=args.seed, quantize=args.seed + 1))
    graphdef, state = nnx.split(model)
    shardings = nnx.get_named_sharding(state, mesh)
    grad_shardings = nnx.get_named_sharding(nnx.state(model, nnx.Param), mesh)  # no rng streams
    state = jax.device_put(state, shardings)
    x_sharding = NamedSharding(mesh, P(("data", "expert"), None, None))
    x_host = np.random.default_rng(args.seed).standard_normal((args.tokens // args.seq, args.seq, args.d_model))
    x = jax.device_put(jnp.asarray(x_host, jnp.bfloat16), x_sharding)

    def loss_fn(model, x):
        out, aux = model(x)
        return jnp.sum(jnp.square(out.astype(jnp.float32))) + aux

    def step(state, x):
        model = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, x)
        grads = nnx.state(grads)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)))
        return loss, norm, grads

    rep = NamedSharding(mesh, P())
    jitted = jax.jit(step, in_shardings=(shardings, x_sharding), out_shardings=(rep, rep, grad_shardings))
    stage("lower")
    t0 = time.perf_counter()
    lowered = jitted.lower(state, x)
    stage("compile")
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    text = compiled.as_text() or ""
    hlo = {"while": text.count(" while("), "all_to_all": text.count(" all-to-all("),
           "jf4_custom_calls": text.count('custom_call_target="jf4_'),
           "custom_calls": text.count(" custom-call(")}
    stage("run")
    loss, norm, grads = compiled(state, x)
    loss, norm = float(loss), float(norm)
    t3 = time.perf_counter()
    stage("steps")
    times = []
    for _ in range(args.steps):
        s = time.perf_counter()
        jax.block_until_ready(compiled(state, x))
        times.append(time.perf_counter() - s)
    stage("done")
    return {"weights_sha256": weights_digest(state), "variant": variant.fields(), "loss": loss,
            "loss_bits": f"{np.float32(loss).view(np.uint32):08x}",
            "grad_norm": norm, "finite": bool(np.isfinite(loss) and np.isfinite(norm)),
            "ms_per_step": 1e3 * float(np.median(times)) if times else None, "lower_s": t1 - t0,
            "compile_s": t2 - t1, "first_run_s": t3 - t2, "hlo": hlo, "backend": backend,
            "devices": [d.device_kind for d in jax.devices()[:n_dev]], "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "jax_fp4_cuda_kernels": ffi.HAS_CUDA_KERNELS,
            "jax_fp4_cpu_kernels": ffi.HAS_CPU_KERNELS, "xla_flags": os.environ.get("XLA_FLAGS", "")}


# --------------------------------------------------------------------------------------------------------------------
# The driver: every variant in its own process.


def size_args(args) -> list[str]:
    return ["--layers", str(args.layers), "--d-model", str(args.d_model), "--hidden", str(args.hidden),
            "--experts", str(args.experts), "--top-k", str(args.top_k), "--tokens", str(args.tokens), "--seq",
            str(args.seq), "--data", str(args.data), "--expert", str(args.expert), "--steps", str(args.steps),
            "--seed", str(args.seed)]


def child_env(variant: Variant, extra_flags: str) -> dict:
    """This process's environment with the variant's (and the driver's --xla-flags) appended to XLA_FLAGS."""
    env = dict(os.environ)
    flags = " ".join(f for f in (env.get("XLA_FLAGS", ""), extra_flags, variant.xla_flags) if f)
    if flags:
        env["XLA_FLAGS"] = flags
    return env


def describe_rc(rc: int | None) -> str:
    if rc is None:
        return "timeout"
    if rc < 0:
        try:
            return f"{rc} ({signal.Signals(-rc).name})"
        except ValueError:
            return str(rc)
    return str(rc)


def run_variant(variant: Variant, args) -> dict:
    """Run one variant in a child process; its record (rc, wall time, last stage, stderr tail, its RESULT)."""
    cmd = [sys.executable, "-P", os.path.abspath(__file__), "--one", variant.name, *size_args(args)]
    env = child_env(variant, args.xla_flags)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
    wall = time.perf_counter() - start
    lines = out.splitlines()
    stages = [ln[len(STAGE):] for ln in lines if ln.startswith(STAGE)]
    results = [json.loads(ln[len(RESULT):]) for ln in lines if ln.startswith(RESULT)]
    return {"name": variant.name, **variant.fields(), "rc": rc, "status": describe_rc(rc), "wall_s": round(wall, 2),
            "last_stage": stages[-1] if stages else None, "result": results[-1] if results else None,
            "stderr_tail": err.splitlines()[-args.tail:], "xla_flags": env.get("XLA_FLAGS", ""),
            "command": " ".join(cmd)}


COLUMNS = (("variant", 50), ("rc", 12), ("stage", 8), ("wall s", 7), ("compile s", 9), ("ms/step", 9),
           ("loss", 14), ("jf4 calls", 9))


def row(rec: dict) -> str:
    res = rec["result"] or {}

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    cells = (rec["name"], rec["status"], rec["last_stage"] or "-", num(rec["wall_s"], ".1f"),
             num(res.get("compile_s"), ".1f"), num(res.get("ms_per_step"), ".1f"), num(res.get("loss"), ".6g"),
             str(res.get("hlo", {}).get("jf4_custom_calls", "-")))
    return " ".join(str(c).ljust(w) for c, (_, w) in zip(cells, COLUMNS, strict=True))


def default_out() -> str:
    out = os.environ.get("OUT")
    return os.path.join(out, "ep_scan_probe.json") if out else "ep_scan_probe.json"


def drive(args) -> int:
    names = args.variants.split(",") if args.variants else list(DEFAULT_VARIANTS)
    variants = [parse_variant(n.strip()) for n in names if n.strip()]
    import jax  # the version only: the driver starts no backend (the children need the devices)

    out = args.out or default_out()
    print(f"ep_scan_probe: jax {jax.__version__}, {len(variants)} variants, {args.layers} layers, "
          f"D={args.d_model} H={args.hidden} E={args.experts} top_k={args.top_k} tokens={args.tokens} "
          f"mesh data={args.data} expert={args.expert}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    print(" ".join(name.ljust(w) for name, w in COLUMNS), flush=True)
    records = []
    for v in variants:
        rec = run_variant(v, args)
        records.append(rec)
        print(row(rec), flush=True)
        if rec["rc"] != 0:
            for line in rec["stderr_tail"][-args.show:]:
                print(f"    | {line}", flush=True)
        doc = {"args": vars(args), "jax": jax.__version__, "base_xla_flags": os.environ.get("XLA_FLAGS", ""),
               "variants": records}
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:  # rewritten after every variant: a killed driver keeps what ran
            json.dump(doc, f, indent=1)
    print(f"wrote {out}", flush=True)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=None,
                   help="comma-separated variant names (default: the DEFAULT_VARIANTS list; grammar in the docstring)")
    p.add_argument("--list", action="store_true", help="print the default variants and exit")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: run this variant here
    p.add_argument("--out", default=None, help="JSON output (default $OUT/ep_scan_probe.json or ./ep_scan_probe.json)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per variant before its process is killed")
    p.add_argument("--xla-flags", default="", help="appended to XLA_FLAGS in every variant's process")
    p.add_argument("--tail", type=int, default=40, help="stderr lines kept per variant in the JSON")
    p.add_argument("--show", type=int, default=12, help="stderr lines printed under a failed variant's row")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=512, help="each expert's width (per SwiGLU half)")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step over the whole mesh")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (x is [tokens / seq, seq, d_model])")
    p.add_argument("--data", type=int, default=1, help="mesh axis 'data' size")
    p.add_argument("--expert", type=int, default=2, help="mesh axis 'expert' size")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the first")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.list:
        print("\n".join(DEFAULT_VARIANTS))
        return 0
    if args.one is not None:
        print(RESULT + json.dumps(run_one(parse_variant(args.one), args)), flush=True)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
