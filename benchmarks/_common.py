"""Shared pieces of the benchmark scripts (benchmarks/*.py): command line, run header, timing, byte accounting,
reference checks, table printing and the JSON results file.

A script imports it after putting its own directory on sys.path (`python -P` does not, for a script):

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/_common.py, also under python -P
    import _common as bench  # noqa: E402

Timing model (time_calls / time_over_buffers): after warm-up, up to `iters` calls (fewer for slow functions, about
`budget_s` per repeat) are enqueued back to back and the wall time until `jax.block_until_ready` is divided by the
calls (times the buffers per call); the best of `repeats` runs is reported.

Pieces: command line `base_parser`, `parse_shapes`, `parse_variants`; run header `setup_device`, `run_info`,
`describe_run`, `kernels_missing`; timing `time_calls`, `time_over_buffers`, `copy_bandwidth`, `bf16_buffers`;
accounting `leaf_bytes`, `tree_bytes`, `bits`, `bits_equal`, `bit_exact_check`, `ratio`, `micros`; output `fmt`,
`fmt_speedup`, `fmt_exact`, `print_table`, `print_summary`, `finish_run`, `write_results`; the skeleton of the
[M, K] benchmarks `start_matrix_run`, `shape_buffers` (see quantize.py / dequantize.py for a whole script).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp4._src import ffi

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPEAT_BUDGET_S = 0.5  # default cap on one timed repeat (slow functions run fewer than `iters` calls)

#: Default --shapes of the [M, K] matrix benchmarks (quantize, dequantize): name -> (M, K); "small": one quick shape.
MATRIX_SHAPES = {
    "square 8192x8192": (8192, 8192),
    "16384x4096": (16384, 4096),
    "llama3-8b mlp down 16384x14336": (16384, 14336),
}
SMALL_MATRIX_SHAPES = {"small 1024x2048": (1024, 2048)}


# ---- command line -----------------------------------------------------------------------------------------------
def base_parser(doc: str, name: str, *, iters: int, repeats: int, shapes_help: str | None = None,
                variants: bool = False) -> argparse.ArgumentParser:
    """The common flags: --out (default benchmarks/results/<name>.json), [--shapes], [--variants], --iters, --repeats.

    doc: the script's __doc__ (its first line is the description). shapes_help: add --shapes (default "default")
    with this help text; variants: add --variants (default None: all), a comma list for `parse_variants`.
    """
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, f"{name}.json"))
    if shapes_help is not None:
        ap.add_argument("--shapes", default="default", help=shapes_help)
    if variants:
        ap.add_argument("--variants", default=None, help="comma list of variant ids / names / 1-based numbers")
    ap.add_argument("--iters", type=int, default=iters)
    ap.add_argument("--repeats", type=int, default=repeats)
    return ap


def parse_shapes(spec: str, default: dict = MATRIX_SHAPES, small: dict = SMALL_MATRIX_SHAPES,
                 dims: int | None = 2) -> dict:
    """--shapes: "default" -> `default`, "small" -> `small`, else a comma list of names (keys of either dict) or, when
    `dims` is set, free-form sizes "AxB..." with `dims` integers (named "AxB...": the tuple of ints).

    Returns {name: shape tuple}; an unknown item exits with the known names.
    """
    if spec == "default":
        return default
    if spec == "small":
        return small
    known, shapes = {**default, **small}, {}
    for s in (t.strip() for t in spec.split(",")):
        if s in known:
            shapes[s] = known[s]
            continue
        try:
            dims_ = tuple(int(t) for t in s.lower().split("x"))
        except ValueError:
            dims_ = ()
        if dims is None or len(dims_) != dims:
            free = "" if dims is None else f", or {'x'.join('N' * dims)}"
            raise SystemExit(f"unknown shape {s!r}; known: default, small, {', '.join(known)}{free}")
        shapes["x".join(map(str, dims_))] = dims_
    return shapes


def parse_variants(spec: str | None, variants: Sequence) -> list:
    """--variants: None / "" -> all `variants`; else a comma list of ids, names or 1-based numbers (each item needs
    `.id` and `.name`). Keeps the order of `variants`' first match per item, without repeats; unknown -> exit."""
    if not spec:
        return list(variants)
    picked = []
    for s in (t.strip() for t in spec.split(",")):
        hit = [v for i, v in enumerate(variants, 1) if s in (v.id, v.name, str(i))]
        if not hit:
            known = ", ".join(v.id for v in variants)
            raise SystemExit(f"unknown variant {s!r}; known: {known} (or 1..{len(variants)})")
        picked += [v for v in hit if v not in picked]
    return picked


# ---- run header -------------------------------------------------------------------------------------------------
def setup_device(reference_note: str):
    """The default device; prints a warning when it is not a GPU and when the CUDA extension is missing (then
    "<reference_note> runs the reference", e.g. "'jf4_quantize'")."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        print(f"warning: default device is {dev} (not a GPU); numbers are not representative")
    if not ffi.HAS_CUDA_KERNELS:
        print(f"warning: CUDA extension missing ({ffi.import_error()}); {reference_note} runs the reference")
    return dev


def run_info(dev) -> dict:
    """The results JSON's leading keys: device, platform, jax, python, has_cuda_kernels (scripts add method etc.)."""
    return {
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": dev.platform,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "has_cuda_kernels": ffi.HAS_CUDA_KERNELS,
    }


def describe_run(results: dict) -> str:
    """"device: <device>  jax <version>  (<method>)" from a results dict."""
    return f"device: {results['device']}  jax {results['jax']}  ({results['method']})"


def kernels_missing(fn, args: Sequence, names: Iterable[str]) -> list[str]:
    """The custom calls of `names` absent from jit(fn)'s lowering for args (i.e. the reference path would be timed);
    [] without checking when the default device is not a GPU or the CUDA extension is missing."""
    if jax.devices()[0].platform != "gpu" or not ffi.HAS_CUDA_KERNELS:
        return []
    text = jax.jit(fn).lower(*args).as_text()
    return [k for k in names if f"custom_call @{k}" not in text]


# ---- timing -----------------------------------------------------------------------------------------------------
def time_calls(fn, argsets: Sequence[tuple], iters: int, repeats: int, *, per_call: int = 1, warmup: int = 1,
               budget_s: float | None = REPEAT_BUDGET_S, keep: bool = False):
    """(best seconds per call / per_call, outputs of the last call if keep else None) of back-to-back calls of fn.

    Call i runs fn(*argsets[i % len(argsets)]). After `warmup` calls (the first compiles a jitted fn), one more call
    is timed to size a repeat: n = min(iters, budget_s / its time) calls, at least 1 (n = iters if budget_s is None).
    Each of `repeats` repeats enqueues n calls and waits with jax.block_until_ready; the best repeat counts.
    """
    for i in range(warmup):
        jax.block_until_ready(fn(*argsets[i % len(argsets)]))
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*argsets[0]))
    n = iters if budget_s is None else max(1, min(iters, int(budget_s / max(time.perf_counter() - t0, 1e-9))))
    best = float("inf")
    for _ in range(repeats):
        out = None  # free the previous outputs first
        t0 = time.perf_counter()
        for i in range(n):
            out = fn(*argsets[i % len(argsets)])
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / (n * per_call))
    return best, (out if keep else None)


def time_over_buffers(fn, bufs: Sequence, iters: int, repeats: int, *, auxs: Sequence[tuple] | None = None,
                      budget_s: float | None = REPEAT_BUDGET_S, keep: bool = False):
    """(best seconds per single-buffer application of fn(x, *aux), the last call's tuple of outputs if keep).

    fn is jitted over all of `bufs` (K rotated inputs, any pytrees) at once, with auxs[i] (a tuple of extra
    arguments, default ()) for bufs[i]: one Python dispatch covers K kernels and no input stays in L2. Timed by
    time_calls (one warm-up call, `budget_s` per repeat; None: exactly `iters` calls).
    """
    auxs = [()] * len(bufs) if auxs is None else auxs
    f = jax.jit(lambda xs, ays: tuple(fn(x, *a) for x, a in zip(xs, ays, strict=True)))
    return time_calls(f, [(bufs, auxs)], iters, repeats, per_call=len(bufs), budget_s=budget_s, keep=keep)


def copy_bandwidth(bufs: Sequence, iters: int, repeats: int, *, budget_s: float | None = REPEAT_BUDGET_S,
                   label: str | None = None) -> tuple[float, float]:
    """(seconds, GB/s) of a device-to-device copy (jit(jnp.copy), read + write bytes) of one of the rotated arrays
    `bufs`, timed by time_over_buffers; prints "[label] copy bandwidth ..." if label."""
    t, _ = time_over_buffers(jnp.copy, bufs, iters, repeats, budget_s=budget_s)
    gbs = 2 * tree_bytes(bufs[0]) / t / 1e9
    if label is not None:
        print(f"[{label}] copy bandwidth {gbs / 1e3:.2f} TB/s ({t * 1e6:.1f} µs)", flush=True)
    return t, gbs


def copy_summary(copy_gbps: dict) -> str:
    """One line of the {name: GB/s} copy bandwidths, in TB/s."""
    return "copy bandwidth (D2D, R+W): " + ", ".join(f"{s}: {g / 1e3:.2f} TB/s" for s, g in copy_gbps.items())


def bf16_buffers(shape, k: int, key) -> list:
    """k standard-normal bfloat16 arrays of `shape` (keys split from `key`), ready on the device."""
    return jax.block_until_ready([jax.random.normal(kk, shape, jnp.float32).astype(jnp.bfloat16)
                                  for kk in jax.random.split(key, k)])


# ---- accounting / checks ----------------------------------------------------------------------------------------
def leaf_bytes(leaf) -> int:
    """Bytes of an array (or ShapeDtypeStruct): float4 at 4 bits, PRNG keys at their key-data size."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    dt = jnp.dtype(leaf.dtype)
    bits = 4 if dt.name.startswith("float4") else 8 * dt.itemsize
    return -(-math.prod(leaf.shape) * bits // 8)


def tree_bytes(tree) -> int:
    """leaf_bytes summed over the leaves of a pytree (arrays or ShapeDtypeStructs, e.g. from jax.eval_shape)."""
    return sum(leaf_bytes(leaf) for leaf in jax.tree_util.tree_leaves(tree))


def bits(a) -> np.ndarray:
    """The host copy of `a` viewed as unsigned integers of its itemsize (for bit-exact comparisons)."""
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def bits_equal(a, b) -> bool:
    """a and b have the same shape and bits (NaN payloads included)."""
    return bool(np.array_equal(bits(a), bits(b)))


def bit_exact_check(label: str, check: Callable[..., bool], *args) -> bool | None:
    """bool(check(*args)) (e.g. a bit comparison of outputs with the reference's), printing a warning when False;
    None, with a note, when check raises (e.g. no host copy of float4), so the timing goes on."""
    try:
        ok = bool(check(*args))
    except Exception as e:
        print(f"note: {label}: reference check skipped ({type(e).__name__}: {str(e)[:200]})")
        return None
    if not ok:
        print(f"warning: {label}: output differs from the reference")
    return ok


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is None (e.g. a speed-up t_ref / t without a reference time)."""
    return None if a is None or b is None else a / b


def micros(t: float | None) -> float | None:
    """Seconds -> µs, None stays None."""
    return None if t is None else t * 1e6


# ---- output -----------------------------------------------------------------------------------------------------
def fmt(x, spec: str, missing: str = "-") -> str:
    """format(x, spec), or `missing` for None."""
    return missing if x is None else format(x, spec)


def fmt_speedup(x, spec: str = ".1f", missing: str = "-") -> str:
    """A speed-up cell: format(x, spec) + "x", or `missing` for None."""
    return missing if x is None else format(x, spec) + "x"


def fmt_exact(ok: bool | None) -> str:
    """A bit-exactness cell: "yes", "NO", or "" (not checked)."""
    return {True: "yes", False: "NO", None: ""}[ok]


def print_table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[str]]) -> None:
    """Prints a header line, a rule and one line per row; columns: (title, alignment + width, e.g. "<24" or ">9"),
    cells: strings already formatted, one per column, joined by single spaces."""
    hdr = " ".join(f"{title:{spec}}" for title, spec in columns)
    print(hdr)
    print("-" * len(hdr))
    for row in rows:
        print(" ".join(f"{cell:{spec}}" for cell, (_, spec) in zip(row, columns, strict=True)))


def finish_run(results: dict, path: str, t_start: float) -> None:
    """Prints the total time since t_start (time.perf_counter()) and writes the results (write_results)."""
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    write_results(results, path)


def write_results(results: dict, path: str) -> None:
    """Writes results as indented JSON to path (creating its directory) and prints where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {path}")


# ---- the [M, K] matrix benchmarks (quantize, dequantize) ----------------------------------------------------------
def start_matrix_run(doc: str, name: str, variants: Sequence, reference_note: str, k: int, *, inputs: str = "buffers",
                     iters: int = 20, repeats: int = 3):
    """The start of an [M, K] matrix benchmark (quantize, dequantize): parses --out / --shapes (MATRIX_SHAPES) /
    --variants / --iters / --repeats, sets up the device (`setup_device(reference_note)`) and prints the run line.

    Returns (args, shapes, picked variants, results) with results = run_info + "method" (jit over `k` rotated
    `inputs`, ...) + "copy_GBps" {} + "rows" [] (the JSON layout the matrix benchmarks share).
    """
    args = base_parser(doc, name, iters=iters, repeats=repeats, variants=True,
                       shapes_help="default | small (1024x2048) | comma list of MxK").parse_args()
    shapes, picked = parse_shapes(args.shapes), parse_variants(args.variants, variants)
    results = {
        **run_info(setup_device(reference_note)),
        "method": f"jit over {k} rotated {inputs}, best of {args.repeats} x <= {args.iters} calls, block_until_ready",
        "copy_GBps": {},
        "rows": [],
    }
    print(describe_run(results), flush=True)
    return args, shapes, picked, results


def shape_buffers(shapes: dict, results: dict, k: int, key, *, iters: int, repeats: int):
    """For each name, shape of `shapes`: k rotated bf16 buffers (bf16_buffers) and their copy bandwidth (printed and
    stored in results["copy_GBps"][name]). Yields (index, name, shape, buffers, copy GB/s); frees the buffers after."""
    for i, (name, shape) in enumerate(shapes.items()):
        bufs = bf16_buffers(shape, k, key)
        _, results["copy_GBps"][name] = copy_bandwidth(bufs, iters, repeats, label=name)
        yield i, name, shape, bufs, results["copy_GBps"][name]
        del bufs


def print_summary(results: dict, note: str) -> None:
    """After the runs: a blank line, the run line (describe_run), the copy bandwidths if any, and `note`."""
    print("\n" + describe_run(results))
    if results.get("copy_GBps"):
        print(copy_summary(results["copy_GBps"]))
    print(note)
