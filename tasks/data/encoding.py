"""Token ids from documents: the flat shard files every training stage reads (one file per split,
each document's ids followed by the end-of-document id). Shared by tokenize and its parallel pieces."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

ENCODE_BATCH_BYTES = 4 * 2**20  # big enough for the Rust side to use every core, small enough to stream


def shard_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def encode_to_shard(
    tokenizer: Tokenizer,
    docs: list[str],
    eod_id: int,
    dtype: np.dtype,
    path: Path,
    on_progress: Callable[[int], None] | None = None,
) -> int:
    """Encode documents in byte-sized batches and append them to a flat token file; returns tokens written."""
    written = 0
    with open(path, "wb") as f:
        for out, batch in _encoded_batches(tokenizer, docs, eod_id, dtype):
            out.tofile(f)
            written += len(out)
            if on_progress:
                on_progress(sum(len(d) for d in batch))
    return written


def encode_to_array(tokenizer: Tokenizer, docs: list[str], eod_id: int, dtype: np.dtype) -> np.ndarray:
    """The tokens encode_to_shard would write for these documents, as one array (a parallel piece)."""
    arrays = [out for out, _ in _encoded_batches(tokenizer, docs, eod_id, dtype)]
    return np.concatenate(arrays) if arrays else np.empty(0, dtype=dtype)


def _encoded_batches(tokenizer: Tokenizer, docs: list[str], eod_id: int,
                     dtype: np.dtype) -> Iterator[tuple[np.ndarray, list[str]]]:
    """(tokens, documents) per batch: each document's ids followed by the end-of-document id."""
    # Text that happens to contain the special token's spelling stays text, so document
    # boundaries in the shard are exactly the ones we put there.
    tokenizer.encode_special_tokens = True
    for batch in _batches_by_bytes(docs, ENCODE_BATCH_BYTES):
        encodings = tokenizer.encode_batch_fast(batch, add_special_tokens=False)
        lengths = [len(e.ids) + 1 for e in encodings]
        out = np.empty(sum(lengths), dtype=dtype)
        pos = 0
        for enc, n in zip(encodings, lengths):
            out[pos : pos + n - 1] = enc.ids
            out[pos + n - 1] = eod_id
            pos += n
        yield out, batch


def _batches_by_bytes(docs: list[str], batch_bytes: int) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def decode_shard(tokenizer: Tokenizer, path: Path, dtype: np.dtype, eod_id: int) -> list[str]:
    """The documents a shard holds, decoded back to text (for checks and tests)."""
    ids = np.fromfile(path, dtype=dtype)
    ends = np.flatnonzero(ids == eod_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(ids[s:e].tolist(), skip_special_tokens=False) for s, e in zip(starts, ends)]
