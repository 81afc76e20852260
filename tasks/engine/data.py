"""Token shards as training data: memory-mapped, sampled deterministically from (seed, step, rank)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from cpuforge.tasks.records.errors import DataError


@dataclass
class Shards:
    train: np.memmap
    val: np.memmap
    meta: dict
    tokenizer_path: Path

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def eod_id(self) -> int:
        return int(self.meta["eod_id"])


def open_shards(folder: Path, block_size: int) -> Shards:
    """Open the tokenize stage's output; refuse shards that cannot hold one training sequence."""
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        raise DataError(f"no token shards in {folder}: meta.json is missing (run the tokenize stage)")
    meta = json.loads(meta_path.read_text())
    arrays = {}
    for split in ("train", "val"):
        path = folder / f"{split}.bin"
        if not path.is_file():
            raise DataError(f"token shard {path} is missing")
        arrays[split] = np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")
        if len(arrays[split]) < block_size + 2:
            raise DataError(
                f"the {split} shard holds {len(arrays[split])} tokens, fewer than one sequence of "
                f"model.block_size={block_size} (+1); use more text or a smaller block_size"
            )
    return Shards(arrays["train"], arrays["val"], meta, folder / "tokenizer.json")


def corpus_prompts(shards: Shards, n: int = 3, words: int = 3, max_tokens: int = 16,
                   scan_tokens: int = 1 << 20) -> list[str]:
    """Prompts in the corpus' own words: the opening words of `n` validation documents spread over the
    split (a sample of prose from a prose corpus, of code from code). Each ends in a space or the
    opening line's end, so the model writes the next word; at most `max_tokens` tokens (a banner line
    or a long URL has no words to stop at, and a prompt must fit well inside the context)."""
    val = np.asarray(shards.val[:scan_tokens])
    starts = [0, *(np.flatnonzero(val == shards.eod_id) + 1).tolist()]
    starts = [s for s in starts if s < len(val) - 1]
    tokenizer = Tokenizer.from_file(str(shards.tokenizer_path))
    prompts: list[str] = []
    for i in range(n):
        start = starts[i * len(starts) // n]
        ids = val[start:start + 64].tolist()
        ids = ids[:ids.index(shards.eod_id)] if shards.eod_id in ids else ids
        line = next((line for line in tokenizer.decode(ids).splitlines() if line.strip()), "")
        opening = line.split()[:words]
        prompt = " ".join(opening) + (" " if len(line.split()) > words else "")
        encoded = tokenizer.encode(prompt).ids
        if len(encoded) > max_tokens:
            prompt = tokenizer.decode(encoded[:max_tokens])
        if prompt.strip() and prompt not in prompts:
            prompts.append(prompt)
    fallback = tokenizer.decode(val[:8].tolist())
    return prompts or [fallback if fallback.strip() else "The "]


class BatchSampler:
    """Random windows of a shard. Batch (step, micro) on a rank is a pure function of the seed,
    so the data position to resume from is just the step number. Each rank draws from its own
    contiguous slice of the shard (data sharding), reusing one pinned buffer per call."""

    def __init__(self, data: np.memmap, batch_size: int, block_size: int, seed: int, rank: int = 0, world: int = 1):
        self.data, self.B, self.T, self.seed = data, batch_size, block_size, seed
        span = len(data) // world
        self.lo = rank * span
        self.hi = self.lo + span if rank < world - 1 else len(data)
        if self.hi - self.lo < block_size + 2:
            raise DataError(f"rank {rank}'s slice of the train shard is shorter than one sequence")
        self.rank = rank
        self._buf = np.empty((batch_size, block_size + 1), dtype=np.int64)

    def batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, step, micro, self.rank])
        starts = rng.integers(self.lo, self.hi - self.T - 1, size=self.B)
        for i, s in enumerate(starts):
            self._buf[i] = self.data[s:s + self.T + 1]
        xy = torch.from_numpy(self._buf.copy())  # copy: the caller may keep the batch past the next call
        return xy[:, :-1], xy[:, 1:]


def val_batches(val: np.memmap, n_batches: int, batch_size: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of validation windows, evenly spaced over the val shard (same for every eval)."""
    n = n_batches * batch_size
    last = len(val) - block_size - 1
    starts = np.linspace(0, last, num=n).astype(np.int64) if n > 1 else np.array([0])
    windows = np.stack([np.asarray(val[s:s + block_size + 1], dtype=np.int64) for s in starts])
    xy = torch.from_numpy(windows)
    return [(xy[i:i + batch_size, :-1], xy[i:i + batch_size, 1:]) for i in range(0, n, batch_size)]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def token_byte_lengths(tokenizer: Path | Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens): the denominator of bits per byte."""
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_file(str(tokenizer))
    char_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    lengths = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    for token, idx in tokenizer.get_vocab(with_added_tokens=True).items():
        if token in special:
            continue
        if all(c in char_to_byte for c in token):
            lengths[idx] = len(token)  # one character per byte in the byte-level alphabet
        else:
            lengths[idx] = len(tokenizer.decode([idx]).encode("utf-8"))
    return lengths


def unigram_bpb(train: np.memmap, val: np.memmap, vocab_size: int, byte_lengths: np.ndarray) -> float:
    """Bits per byte of a unigram model fitted on train (add-one smoothing), scored on val: the
    baseline a language model must beat by far."""
    counts = np.bincount(np.asarray(train), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log2(counts / counts.sum())
    val_counts = np.bincount(np.asarray(val), minlength=vocab_size)
    bits = -(val_counts * logp).sum()
    return float(bits / max(1, (val_counts * byte_lengths[:vocab_size]).sum()))


def bits_per_byte(nll_nats: float, n_bytes: int) -> float:
    return nll_nats / math.log(2) / max(1, n_bytes)
