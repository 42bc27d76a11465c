"""A byte-level BPE tokenizer for train_lm.py, trained locally on the run's corpus with Hugging Face `tokenizers`.

    corpus = tokenize_corpus(lm_data.load_site_packages(), vocab_size=32768, cache_dir=out / "tokenizer")

Model: byte-level BPE (GPT-2's scheme: text -> UTF-8 bytes -> 256 printable symbols, `pre_tokenizers.ByteLevel`
splitting at GPT-2's word / space / digit boundaries; every byte is in the initial alphabet, so any text encodes and
no token is unknown), no special tokens. Trained with `trainers.BpeTrainer` (min_frequency 2) on at most
``train_bytes`` of the corpus's train split (its first bytes, cut at a newline), never on the validation split.
Text is the corpus bytes decoded as UTF-8 in chunks of about ``CHUNK`` bytes cut at newlines (invalid bytes become
U+FFFD). No download: the corpus is what lm_data loads (the Python sources on this machine).

Deterministic: the same corpus bytes, vocabulary size, ``train_bytes`` and tokenizers version give the same
tokenizer.json and the same token ids (the trainer breaks count ties by the pair itself; the chunks are fed in
corpus order). The tokenizer and the encoded splits are cached in ``cache_dir`` under a key hashing all of these
(a changed corpus trains a new one). Token ids are stored as uint16 (vocab_size <= 65536). Each cache file is
written to a temporary file in ``cache_dir`` and renamed into place (`os.replace`), so runs sharing one cache
directory (precision_study.py links every run's to one) may train at the same time: a reader finds a complete file
or none, never a partial one.

bytes_per_token: the validation split's bytes / its tokens, which turns a loss in nats per token into bits per
byte (loss / ln 2 / bytes_per_token), comparable with byte-level runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from pathlib import Path

import numpy as np

CHUNK = 1 << 16  # bytes of text per encoded / trained string
TRAIN_BYTES = 32 << 20  # default cap on the training text (BPE training time grows with it)
MAX_VOCAB = 1 << 16


def _chunks(data: np.ndarray, limit: int | None = None) -> list[str]:
    """The bytes of `data` (uint8) as UTF-8 strings of about CHUNK bytes, each cut after a newline (at most `limit`
    bytes in all, ending at a newline when cut)."""
    raw = data.tobytes() if limit is None or data.size <= limit else data[:limit].tobytes()
    if limit is not None and data.size > limit and b"\n" in raw:
        raw = raw[: raw.rindex(b"\n") + 1]
    out, start = [], 0
    while start < len(raw):
        end = raw.find(b"\n", start + CHUNK)
        end = len(raw) if end < 0 else end + 1
        out.append(raw[start:end].decode("utf-8", errors="replace"))
        start = end
    return out


def train_bpe(texts, vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` of `vocab_size` tokens (at most; fewer when the text has fewer
    mergeable pairs) trained on the strings `texts` in order.

    Raises:
      ValueError: vocab_size outside [257, 65536] (the 256 byte symbols plus merges; uint16 ids).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not 256 < vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} must be in [257, {MAX_VOCAB}] (256 byte symbols plus merges)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode(tok, data: np.ndarray) -> np.ndarray:
    """uint16 token ids of the bytes `data` (uint8), encoded chunk by chunk (see the module docstring)."""
    chunks = _chunks(data)
    fast = getattr(tok, "encode_batch_fast", tok.encode_batch)
    ids = []
    for i in range(0, len(chunks), 256):
        ids += [np.asarray(e.ids, np.uint16) for e in fast(chunks[i:i + 256], add_special_tokens=False)]
    return np.concatenate(ids) if ids else np.zeros(0, np.uint16)


def cache_key(corpus, vocab_size: int, train_bytes: int) -> str:
    """The hex digest naming a tokenizer and its encoded corpus in the cache."""
    import tokenizers

    h = hashlib.sha256()
    for part in (corpus.train, corpus.val):
        h.update(np.uint64(part.size).tobytes())
        h.update(part.tobytes())
    h.update(json.dumps([vocab_size, train_bytes, CHUNK, tokenizers.__version__]).encode())
    return h.hexdigest()[:16]


def _write_atomic(path: Path, write):
    """Writes `path` through `write(binary file)` into a temporary file of the same directory (named after the
    process and thread, so concurrent writers do not share one), then renames it to `path`: the file appears complete
    or not at all. The temporary file is removed when `write` fails."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        with tmp.open("wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def tokenize_corpus(corpus, vocab_size: int, cache_dir: Path, train_bytes: int = TRAIN_BYTES, log=print):
    """The byte corpus (lm_data.Corpus, uint8 splits) as BPE token ids: a Corpus with uint16 train / val splits,
    ``vocab`` = vocab_size and ``bytes_per_token``; the tokenizer is trained (or loaded from `cache_dir`) as the
    module docstring says; the tokenizer is saved as cache_dir / "bpe-<vocab_size>-<key>.json"."""
    cache_dir = Path(cache_dir)
    key = cache_key(corpus, vocab_size, train_bytes)
    tok_path, ids_path = cache_dir / f"bpe-{vocab_size}-{key}.json", cache_dir / f"tokens-{key}.npz"
    if tok_path.is_file() and ids_path.is_file():
        with np.load(ids_path) as z:
            train, val = z["train"], z["val"]
        log(f"tokenizer: {tok_path} (cached)")
    else:
        tok = train_bpe(_chunks(corpus.train, train_bytes), vocab_size)
        train, val = encode(tok, corpus.train), encode(tok, corpus.val)
        cache_dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(ids_path, lambda f: np.savez(f, train=train, val=val))
        _write_atomic(tok_path, lambda f: f.write(tok.to_str(pretty=True).encode()))
        log(f"tokenizer: trained {tok.get_vocab_size()} tokens on {min(corpus.train.size, train_bytes) / 1e6:.1f} MB "
            f"-> {tok_path}")
    bpt = corpus.val.size / max(val.size, 1)
    desc = (f"{corpus.description}; BPE {vocab_size}: {train.size / 1e6:.2f}M train / {val.size / 1e6:.2f}M "
            f"validation tokens, {bpt:.2f} bytes per token")
    return dataclasses.replace(corpus, train=train, val=val, vocab=vocab_size, bytes_per_token=bpt, description=desc)


def load(path) -> object:
    """A cached tokenizer (`tokenizers.Tokenizer.from_file`), e.g. to decode samples."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
