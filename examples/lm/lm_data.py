"""Byte-level text data for train_lm.py: a corpus split into train / validation and deterministic batches.

Corpora:
  * ``load_site_packages()``: every ``.py`` file under the interpreter's site-packages (the installed libraries'
    sources; ~90 MB with jax, flax and their dependencies), split by file like the stdlib; the medium preset's.
  * default: the Python standard library's own ``.py`` sources on this machine (``sysconfig.get_paths()["stdlib"]``,
    site-packages / dist-packages left out), no download. Split by file: a file is validation when the CRC-32 of its
    path relative to the stdlib root is 0 mod 10 (about 10% of the files, the same on every machine with the same
    Python), so no function is half in train and half in validation.
  * ``load_text_file(path)``: any file, read as bytes; the last 10% (a contiguous region) is validation.
Tokens are the bytes themselves (vocab 256), stored as uint8 arrays; lm_tokenizer turns a corpus into BPE ids.

Batches are [batch, seq + 1] windows (uint8 bytes or uint16 ids) (inputs = [:, :-1], targets = [:, 1:]):
  * training: random window starts from ``np.random.default_rng([seed, step])``, a pure function of (seed, step), so
    every recipe sees the same data in the same order and a resumed run continues with the batches it would have seen;
  * validation: a fixed set of evenly spaced windows over the validation split.
Both take ``rows``: a process of a multi-process run reads only the rows of the global batch its devices hold
(lm_distributed.global_batch), the same windows a one-process run puts there.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
import zlib
from pathlib import Path

import numpy as np

VAL_FRACTION = 0.1
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # uint8 [n_train] bytes (uint16 ids once tokenized, lm_tokenizer)
    val: np.ndarray  # uint8 [n_val]
    description: str
    vocab: int = 256  # token ids are < vocab
    bytes_per_token: float = 1.0  # the validation split's bytes per token (bits per byte = nats / ln 2 / this)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's .py files under root (sorted relative paths), site-packages excluded."""
    return _py_files(stdlib_root() if root is None else Path(root), _SKIP_DIRS)


def _py_files(root: Path, skip: set[str]) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        rel = Path(dirpath).relative_to(root)
        found += [rel / f for f in sorted(filenames) if f.endswith(".py")]
    return found


def is_validation_file(relpath: Path) -> bool:
    """Deterministic file-level split: CRC-32 of the POSIX relative path, 0 mod 10 -> validation."""
    return zlib.crc32(relpath.as_posix().encode()) % round(1 / VAL_FRACTION) == 0


def _load_files(roots_files, what: str) -> Corpus:
    """The files (root, relative path) concatenated in order, each followed by a newline, split by file."""
    parts = {True: [], False: []}
    for root, rel in roots_files:
        try:
            parts[is_validation_file(rel)].append((root / rel).read_bytes() + b"\n")
        except OSError:  # unreadable file: skip it
            continue
    if not parts[True] or not parts[False]:
        raise FileNotFoundError(f"too few .py files in {what} for a train/validation split; pass --data FILE")
    train, val = (np.frombuffer(b"".join(parts[v]), np.uint8) for v in (False, True))
    desc = (f"{what}: {len(roots_files)} .py files, {train.size / 1e6:.1f} MB train / {val.size / 1e6:.1f} MB "
            "validation (split by file)")
    return Corpus(train, val, desc)


def load_stdlib(root: Path | None = None) -> Corpus:
    """The stdlib sources, split by file; files are concatenated in sorted order, each followed by a newline."""
    root = stdlib_root() if root is None else Path(root)
    files = stdlib_files(root)
    if not files:
        raise FileNotFoundError(f"no .py files under {root} (the Python standard library); pass --data FILE")
    return _load_files([(root, f) for f in files], f"Python {sysconfig.get_python_version()} stdlib at {root}")


def site_packages_roots() -> list[Path]:
    """The interpreter's site-packages directories (sysconfig purelib and platlib, deduplicated, existing)."""
    paths = sysconfig.get_paths()
    return [Path(p) for p in dict.fromkeys((paths["purelib"], paths["platlib"])) if Path(p).is_dir()]


def load_site_packages(roots: list[Path] | None = None) -> Corpus:
    """Every .py file under the interpreter's site-packages (the installed libraries' sources, no download), split
    by file like the stdlib (CRC-32 of the path relative to its site-packages directory)."""
    roots = site_packages_roots() if roots is None else [Path(r) for r in roots]
    files = [(r, f) for r in roots for f in _py_files(r, {"__pycache__"})]
    if not files:
        raise FileNotFoundError(f"no .py files under {', '.join(map(str, roots)) or 'site-packages'}; pass --data")
    return _load_files(files, f"site-packages ({', '.join(map(str, roots))})")


def load_text_file(path) -> Corpus:
    """Any file as bytes: the first 90% is train, the last 10% (contiguous) validation."""
    data = np.frombuffer(Path(path).read_bytes(), np.uint8)
    n_val = int(data.size * VAL_FRACTION)
    desc = (f"{path}: {data.size / 1e6:.2f} MB, {data.size - n_val} bytes train / {n_val} bytes validation "
            "(the last 10%)")
    return Corpus(data[: data.size - n_val], data[data.size - n_val:], desc)


def check_sizes(corpus: Corpus, seq: int):
    """ValueError unless both splits hold at least one window of seq + 1 bytes."""
    for name, part in (("train", corpus.train), ("validation", corpus.val)):
        if part.size < seq + 2:
            raise ValueError(f"{corpus.description}: the {name} split has {part.size} bytes, fewer than one window "
                             f"of seq + 1 = {seq + 1}; use a larger file or a smaller --seq")


def _windows(data: np.ndarray, starts: np.ndarray, seq: int) -> np.ndarray:
    return data[starts[:, None] + np.arange(seq + 1)]


def train_batch(corpus: Corpus, step: int, batch: int, seq: int, seed: int, rows: slice = slice(None)) -> np.ndarray:
    """[batch, seq + 1] (the split's dtype): random windows of the train split, a pure function of (seed, step).
    rows: only these rows of it (a process's share of a global batch; the starts of all rows are drawn, only the
    windows of `rows` are read)."""
    starts = np.random.default_rng([seed, step]).integers(0, corpus.train.size - seq - 1, size=batch)
    return _windows(corpus.train, starts[rows], seq)


def val_batches(corpus: Corpus, n: int, batch: int, seq: int, rows: slice = slice(None)) -> list[np.ndarray]:
    """n [batch, seq + 1] batches of evenly spaced windows over the validation split (the same every call); rows:
    only these rows of each (as in `train_batch`)."""
    starts = np.linspace(0, corpus.val.size - seq - 1, n * batch).astype(np.int64)
    return [_windows(corpus.val, s[rows], seq) for s in starts.reshape(n, batch)]
