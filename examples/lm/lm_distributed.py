"""train_lm.py over several processes (one per GPU or per host) on JAX's distributed runtime: joining the run, the
checks of the setup, and each process's share of a global batch.

Joining (`initialize`, before any JAX computation): `--distributed` calls `jax.distributed.initialize()`, which
detects the cluster (SLURM, Open MPI, Kubernetes, ...: the environment its launcher sets) and its coordinator;
`--coordinator HOST:PORT --num-processes N --process-id I` is a plain launch (any launcher, or N shells). Process 0
runs the coordinator; every process connects within `--init-timeout` seconds. After it, `jax.devices()` lists every
process's devices and the --mesh spans them all (its product = the global device count); collectives run over NCCL on
GPUs and gloo on CPUs (jax's default CPU collectives). No launcher or transport of our own.

What is per process and what global (docs/design.md, "Multi-process runs"):
  * --out is one directory on a filesystem every process reaches (`check_shared_dir`);
  * every process loads the corpus and tokenizes it (the BPE trained by process 0 first, then loaded from the cache
    under --out by the others); `check_same` stops the run when the processes' corpora, tokenizer cache keys or
    token ids differ;
  * batches: every process draws the same window starts (a pure function of seed and step, `lm_data`) and reads only
    the rows its devices hold (`batch_rows`); `global_batch` assembles the global array with
    `jax.make_array_from_process_local_data`, so the step sees the global batch of a one-process run;
  * the model state is built identically by every process and placed on the global mesh (each process keeps its
    shards); the losses are replicated, so every process computes the same logs, but only process 0 prints and writes
    curves.csv, the PNGs, summary.json and the diagnostics (`is_primary`);
  * Orbax checkpoints are written by all processes together (each its shards, process 0 the metadata) into one
    directory every process can reach, and restore onto any process count and mesh.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import socket
import sys
import time
from pathlib import Path

import jax
import numpy as np

INIT_TIMEOUT = 300  # seconds (jax.distributed.initialize's default)


def add_arguments(p: argparse.ArgumentParser):
    """The multi-process flags of train_lm.py."""
    g = p.add_argument_group("multi-process runs (JAX distributed runtime; docs: README, 'Train at scale')")
    g.add_argument("--distributed", action="store_true",
                   help="join a multi-process run through jax.distributed.initialize(), which detects the cluster "
                        "(SLURM srun, Open MPI mpirun, Kubernetes, ...) and its coordinator")
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help="a plain multi-process launch: process 0's address and a free port (with --num-processes and "
                        "--process-id; every process gives the same address)")
    g.add_argument("--num-processes", type=int, metavar="N", help="with --coordinator: the number of processes")
    g.add_argument("--process-id", type=int, metavar="I", help="with --coordinator: this process's id, 0 .. N-1")
    g.add_argument("--init-timeout", type=int, default=INIT_TIMEOUT, metavar="S",
                   help=f"seconds to wait for the coordinator and the other processes (default {INIT_TIMEOUT})")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p)
    return p


def setup_problems(args) -> list[str]:
    """Why the multi-process flags of `args` do not make a launch (empty when they do, or when none is given)."""
    plain = (args.coordinator, args.num_processes, args.process_id)
    if all(v is None for v in plain):
        return []
    if args.distributed:
        return ["--distributed detects the cluster itself: give it alone or --coordinator, --num-processes and "
                "--process-id, not both"]
    if any(v is None for v in plain):
        return ["a plain multi-process launch needs all of --coordinator HOST:PORT, --num-processes N and "
                "--process-id I"]
    host, _, port = args.coordinator.rpartition(":")
    errs = []
    if not host or not port.isdigit():
        errs.append(f"--coordinator {args.coordinator!r} is not HOST:PORT (e.g. 127.0.0.1:12355)")
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
        errs.append(f"--process-id {args.process_id} is not in 0 .. --num-processes - 1 = {args.num_processes - 1}")
    if args.init_timeout < 1:
        errs.append(f"--init-timeout {args.init_timeout} must be at least 1 second")
    return errs


def _wait_for(address: str, timeout: float) -> bool:
    """Whether a TCP connection to HOST:PORT opens within timeout seconds (retrying: the coordinator may start
    after this process)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout)):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def initialize(argv=None) -> None:
    """Join the multi-process run the flags in argv (train_lm's command line) name; nothing without them. Must run
    before any JAX computation (it decides what `jax.devices()` lists).

    Raises:
      SystemExit: bad flags (`setup_problems`), or a coordinator (process 0) not reachable within --init-timeout
        (probed before jax.distributed.initialize, which would abort the process instead of raising).
    """
    args, _ = _parser().parse_known_args(argv)
    errs = setup_problems(args)
    if errs:
        raise SystemExit("train_lm.py: error: " + "; ".join(errs))
    if (args.coordinator is None and not args.distributed) or jax.distributed.is_initialized():
        return  # one process, or joined already (main called again in this process)
    if args.coordinator is not None and args.process_id > 0 and not _wait_for(args.coordinator, args.init_timeout):
        raise SystemExit(f"train_lm.py: error: process {args.process_id} of {args.num_processes}: the coordinator "
                         f"{args.coordinator} did not answer within --init-timeout {args.init_timeout} s; start "
                         "process 0 (--process-id 0) with the same --coordinator, give it an address this host can "
                         "reach, or raise --init-timeout")
    if args.coordinator is not None and args.process_id == 0:  # jax aborts the process when the others stay away
        print(f"process 0 of {args.num_processes}: the coordinator at {args.coordinator} waits {args.init_timeout} s "
              f"for processes 1 .. {args.num_processes - 1}; an abort with DEADLINE_EXCEEDED after that means they "
              "did not join: start them with the same --coordinator and --num-processes", file=sys.stderr, flush=True)
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                               initialization_timeout=args.init_timeout)


def is_primary() -> bool:
    """Whether this process writes the run's logs and files (process 0)."""
    return jax.process_index() == 0


def barrier(name: str):
    """Every process waits here until all have arrived (no-op in one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def digest(*arrays: np.ndarray) -> str:
    """SHA-256 (hex, 16 digits) of the arrays' dtypes, sizes and bytes."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(f"{a.dtype.str}{a.size}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def check_same(value: str, what: str, fix: str):
    """SystemExit unless every process passes the same `value` (an ASCII string, e.g. a `digest`); the message names
    `what` differs, each process's value, and `fix`."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    raw = np.frombuffer(value.encode().ljust(64)[:64], np.uint8)
    values = [bytes(r).decode().strip() for r in np.asarray(multihost_utils.process_allgather(raw))]
    if len(set(values)) > 1:
        per = ", ".join(f"process {i}: {v}" for i, v in enumerate(values))
        raise SystemExit(f"train_lm.py: error: {what} differ between the processes ({per}); {fix}")


def mesh_problems(mesh_shape, batch: int, seq: int) -> list[str]:
    """Why the global --mesh (data, fsdp, tensor) does not suit the processes (empty in one process): every process
    must hold the same number of the mesh's devices, and the rows of the batch its devices hold must be one contiguous
    range (`process_rows`)."""
    n = jax.process_count()
    if n == 1:
        return []
    if mesh_shape is None:
        return [f"{n} processes need a --mesh over all {jax.device_count()} devices (e.g. --mesh "
                f"{jax.device_count()}x1 for data parallelism)"]
    per = collections.Counter(d.process_index for d in jax.devices())  # every process's devices, no collective
    local = [per[i] for i in range(n)]
    shape = "x".join(map(str, mesh_shape))
    if len(set(local)) > 1 or np.prod(mesh_shape) % n:
        return [f"--mesh {shape} over {n} processes holding {', '.join(map(str, local))} devices: the process count "
                f"must divide the mesh and every process must hold the same number of devices; give each process "
                f"the same devices (CUDA_VISIBLE_DEVICES, --xla_force_host_platform_device_count) and a mesh whose "
                f"product is a multiple of {n}"]
    import lm_mesh

    try:
        process_rows(lm_mesh.batch_sharding(lm_mesh.make_mesh(*mesh_shape)), batch, seq)
    except ValueError as e:
        return [f"--mesh {shape}: {e}"]
    return []


def process_rows(sharding, batch: int, seq: int, process: int | None = None) -> tuple[int, int]:
    """[lo, hi): the rows of a [batch, seq + 1] token batch that `process`'s devices hold under `sharding` (default:
    this process's).

    Raises:
      ValueError: the rows are not one contiguous range (the batch does not split over the processes).
    """
    process = jax.process_index() if process is None else process
    rows = set()
    for device, index in sharding.devices_indices_map((batch, seq + 1)).items():
        if device.process_index == process:
            rows.update(range(*index[0].indices(batch)))
    lo, hi = (min(rows), max(rows) + 1) if rows else (0, 0)
    if not rows or len(rows) != hi - lo:
        raise ValueError(f"the batch of {batch} sequences does not split over the processes: process {process}'s "
                         f"devices hold rows {sorted(rows)[:8]}{'...' if len(rows) > 8 else ''}, not one contiguous "
                         "range; order the mesh so that each process's devices hold adjacent batch shards (the data "
                         "and fsdp axes outermost across processes)")
    return lo, hi


def check_shared_dir(path: Path):
    """SystemExit unless `path` (--out, created) is one directory every process reaches: process 0 writes a marker
    with a token it broadcasts, and every process must read that token there (the checkpoints are written into it by
    all processes together)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    token = "-".join(map(str, np.asarray(multihost_utils.broadcast_one_to_all(
        np.random.default_rng().integers(0, 2**31 - 1, 4, dtype=np.int32)))))
    marker = Path(path) / ".processes"
    if is_primary():
        marker.write_text(token)
    barrier("out marker")
    sees = marker.is_file() and marker.read_text() == token
    seen = np.asarray(multihost_utils.process_allgather(np.int32(sees)))
    if not seen.all():
        bad = ", ".join(str(i) for i, v in enumerate(seen) if not v)
        raise SystemExit(f"train_lm.py: error: --out {path} is not one directory for all processes: process(es) "
                         f"{bad} do not see the marker process 0 wrote there; give every process the same --out on a "
                         "filesystem they share (all of them write the checkpoints there)")


def batch_rows(mesh, batch: int, seq: int) -> slice:
    """The rows of a [batch, seq + 1] token batch this process reads: all without a mesh, else `process_rows` of
    `lm_mesh.batch_sharding(mesh)`."""
    if mesh is None:
        return slice(None)
    import lm_mesh

    return slice(*process_rows(lm_mesh.batch_sharding(mesh), batch, seq))


def global_batch(local: np.ndarray, mesh, batch: int, seq: int):
    """The [batch, seq + 1] token batch from this process's rows `local` (those of `batch_rows`): without a mesh,
    `local` itself (numpy, the whole batch); on a mesh, a global jax.Array with `lm_mesh.batch_sharding` assembled
    by `jax.make_array_from_process_local_data` (each process passing its own rows)."""
    if mesh is None:
        return local
    import lm_mesh

    return jax.make_array_from_process_local_data(lm_mesh.batch_sharding(mesh), local, (batch, seq + 1))


def host_tree(tree):
    """The tree with every array as a host numpy array of its global value (typed PRNG keys as their key data; arrays
    sharded over other processes' devices gathered with `multihost_utils.process_allgather`)."""
    from jax.experimental import multihost_utils

    def host(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(host, tree)
