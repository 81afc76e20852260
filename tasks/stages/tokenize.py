"""Stage 1, tokenize: corpus -> tokenizer.json + train.bin/val.bin token shards + meta.json.

Shards are flat arrays of token ids (uint16 while the vocabulary fits, else uint32), one
end-of-document token after every document, which training reads with ``np.memmap``.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cpuforge.models.fileio import atomic_write_json
from cpuforge.tasks import stages
from cpuforge.tasks.config.settings import DataConfig, TokenizerConfig
from cpuforge.tasks.data.corpus import Corpus, load_corpus
from cpuforge.tasks.data.encoding import encode_to_shard, shard_dtype
from cpuforge.tasks.data.parallel_encode import choose_runner, encode_split_in_parallel
from cpuforge.tasks.engine.progress import progress_bar
from cpuforge.tasks.infra import live
from cpuforge.tasks.infra.stage import StageOutput, StageRun
from cpuforge.tasks.records.errors import DataError

log = logging.getLogger("cpuforge.tokenize")

SPEC = stages.TOKENIZE
META_FORMAT = 1


# --- documents ------------------------------------------------------------------------------


def chunk_documents(docs: list[str], chunk_bytes: int, min_docs: int) -> list[str]:
    """Cut long documents at line boundaries, so even a one-file corpus can be split by document.

    The pieces concatenate back to the original text exactly.
    """
    total = sum(len(d.encode("utf-8")) for d in docs)
    if len(docs) < min_docs:
        chunk_bytes = max(1, min(chunk_bytes, total // min_docs))
    out: list[str] = []
    for doc in docs:
        if len(doc.encode("utf-8")) <= chunk_bytes:
            out.append(doc)
            continue
        piece: list[str] = []
        size = 0
        for line in doc.splitlines(keepends=True):
            piece.append(line)
            size += len(line.encode("utf-8"))
            if size >= chunk_bytes:
                out.append("".join(piece))
                piece, size = [], 0
        if piece:
            out.append("".join(piece))
    return out


def split_documents(docs: list[str], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic document-level split: a document's side depends only on its content and the seed.

    Adding documents never moves existing ones across the split, and duplicates land together,
    so the validation set never leaks into training.
    """
    if len(docs) < 2:
        raise DataError(
            f"the corpus holds {len(docs)} document(s) of text even after cutting it into chunks; "
            "a train/val split needs at least 2 (add text, or lower data.chunk_bytes)"
        )
    salt = seed.to_bytes(8, "little", signed=True)
    scores = [
        int.from_bytes(hashlib.blake2b(doc.encode("utf-8"), digest_size=8, key=salt).digest(), "little") / 2**64
        for doc in docs
    ]
    val = [i for i, s in enumerate(scores) if s < val_fraction]
    if not val:  # small corpora: hold out the lowest-scoring document
        val = [min(range(len(docs)), key=scores.__getitem__)]
    if len(val) == len(docs):
        val = val[:-1]
    val_set = set(val)
    train = [i for i in range(len(docs)) if i not in val_set]
    return train, val


# --- tokenizer ------------------------------------------------------------------------------


def train_tokenizer(docs: list[str], cfg: TokenizerConfig) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization) trained on at most cfg.train_max_bytes of text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=[cfg.eod_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def sample() -> Iterator[str]:
        budget = cfg.train_max_bytes
        for doc in docs:
            if budget <= 0:
                return
            budget -= len(doc)
            yield doc

    tokenizer.train_from_iterator(sample(), trainer=trainer, length=len(docs))
    return tokenizer


def load_tokenizer(path: Path, eod_token: str) -> Tokenizer:
    if not path.is_file():
        raise DataError(f"tokenizer.path: no such file: {path}")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:
        raise DataError(f"tokenizer.path: {path} is not a tokenizers JSON file ({exc})") from None
    if tokenizer.token_to_id(eod_token) is None:
        raise DataError(
            f"tokenizer.path: {path} has no {eod_token!r} token; add it or set tokenizer.eod_token to one it has"
        )
    return tokenizer


# --- the stage ------------------------------------------------------------------------------


def work(run: StageRun, data: DataConfig, tokenizer: TokenizerConfig) -> StageOutput:
    return tokenize(data, tokenizer, run.out_dir, run.cache_dir, run.report)


def tokenize(data: DataConfig, tok_cfg: TokenizerConfig, out_dir: Path, cache_dir: Path,
             report: live.Report = live.nothing) -> StageOutput:
    """Load the corpus, split it, get a tokenizer, write both shards and meta.json into out_dir.
    ``report(fraction, headline)`` follows it: loading is the first 10%, the tokenizer the next 20%,
    encoding the rest by characters encoded."""
    for stale in out_dir.iterdir():  # leftovers of an interrupted attempt: start clean
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()

    t0 = time.perf_counter()
    corpus, docs, splits = read_splits(data, cache_dir)
    load_seconds = time.perf_counter() - t0
    report(0.1, {"phase": "training the tokenizer" if not tok_cfg.path else "loading the tokenizer",
                 "documents": len(docs)}, force=True)

    t0 = time.perf_counter()
    tokenizer, trained = get_tokenizer(tok_cfg, splits["train"])
    tokenizer_seconds = time.perf_counter() - t0
    eod_id = tokenizer.token_to_id(tok_cfg.eod_token)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = shard_dtype(vocab_size)
    tokenizer.save(str(out_dir / "tokenizer.json"))

    stats, encode_seconds = encode_splits(splits, tokenizer, eod_id, dtype, out_dir, data, report)
    meta = shards_meta(corpus, docs, stats, tok_cfg, trained, dtype.name, vocab_size, eod_id)
    atomic_write_json(out_dir / "meta.json", meta)
    seconds = {"load_seconds": load_seconds, "tokenizer_seconds": tokenizer_seconds, "encode_seconds": encode_seconds}
    return stage_output(corpus, data, meta, seconds)


def read_splits(data: DataConfig, cache_dir: Path) -> tuple[Corpus, list[str], dict[str, list[str]]]:
    """The corpus, its documents after chunking, and those documents split into train and val."""
    corpus: Corpus = load_corpus(data, cache_dir)
    docs = chunk_documents(corpus.docs, data.chunk_bytes, data.min_docs)
    train_idx, val_idx = split_documents(docs, data.val_fraction, data.split_seed)
    return corpus, docs, {"train": [docs[i] for i in train_idx], "val": [docs[i] for i in val_idx]}


def get_tokenizer(tok_cfg: TokenizerConfig, train_docs: list[str]) -> tuple[Tokenizer, bool]:
    """tokenizer.path's tokenizer, or one trained on the train split (True); warns when it learned fewer tokens."""
    if tok_cfg.path:
        return load_tokenizer(Path(tok_cfg.path).expanduser(), tok_cfg.eod_token), False
    tokenizer = train_tokenizer(train_docs, tok_cfg)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size < tok_cfg.vocab_size:
        log.warning(
            "the tokenizer learned %d of the %d tokens asked for: the train split has no more pairs seen "
            "tokenizer.min_frequency=%d times (a bigger corpus or a smaller vocab_size fixes this)",
            vocab_size, tok_cfg.vocab_size, tok_cfg.min_frequency,
        )
    return tokenizer, True


def encode_splits(splits: dict[str, list[str]], tokenizer: Tokenizer, eod_id: int, dtype: np.dtype, out_dir: Path,
                  data: DataConfig, report: live.Report) -> tuple[dict[str, dict[str, int | str]], float]:
    """Each split into <name>.bin (by workers when it is big enough); its counts, and the seconds encoding took."""
    stats: dict[str, dict[str, int | str]] = {}
    encode_seconds = 0.0
    runner, why = choose_runner(data)
    log.info("encode runner for splits over %d characters: %s (%s)", data.piece_bytes, runner, why)
    all_chars = sum(len(d) for split_docs in splits.values() for d in split_docs)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    encoded = 0  # characters of both splits, for the live progress

    def encoding(name: str, n: int) -> None:
        nonlocal encoded
        encoded += n
        seconds = encode_seconds + time.perf_counter() - t0
        report(0.3 + 0.7 * encoded / max(1, all_chars),
               {"phase": f"encoding the {name} split", "characters/s": encoded / seconds if seconds > 0 else 0.0,
                "characters": f"{encoded:,} of {all_chars:,}", "vocabulary": vocab_size})

    for name, split_docs in splits.items():
        n_bytes = sum(len(d.encode("utf-8")) for d in split_docs)
        t0 = time.perf_counter()
        chars = sum(len(d) for d in split_docs)
        if runner != "single" and chars > data.piece_bytes:  # big enough to be worth workers
            tokens = encode_split_in_parallel(tokenizer, split_docs, eod_id, dtype, out_dir / f"{name}.bin", data)
            encoding(name, chars)
        else:
            with progress_bar(f"tokenize {name} (chars)", chars) as advance:
                def advance_both(n: int) -> None:
                    advance(n)
                    encoding(name, n)

                tokens = encode_to_shard(tokenizer, split_docs, eod_id, dtype, out_dir / f"{name}.bin", advance_both)
        encode_seconds += time.perf_counter() - t0
        log.info("%s: %d docs, %d bytes -> %d tokens", name, len(split_docs), n_bytes, tokens)
        stats[name] = {"docs": len(split_docs), "bytes": n_bytes, "tokens": tokens, "file": f"{name}.bin"}
    return stats, encode_seconds


def shards_meta(corpus: Corpus, docs: list[str], stats: dict[str, dict[str, int | str]], tok_cfg: TokenizerConfig,
                trained: bool, dtype: str, vocab_size: int, eod_id: int) -> dict[str, Any]:
    """meta.json: how to read the shards, what they hold and where they came from."""
    total_tokens = sum(int(s["tokens"]) for s in stats.values())
    total_docs = sum(int(s["docs"]) for s in stats.values())
    return {
        "format": META_FORMAT,
        "dtype": dtype,
        "vocab_size": vocab_size,
        "eod_token": tok_cfg.eod_token,
        "eod_id": eod_id,
        "splits": stats,
        "bytes_per_token": round(sum(int(s["bytes"]) for s in stats.values()) / max(1, total_tokens - total_docs), 4),
        "source": {
            "kind": corpus.kind,
            "source": corpus.source,
            "files": corpus.files,
            "documents_read": len(corpus.docs),
            "documents_after_chunking": len(docs),
            "fingerprint": corpus.fingerprint,
            "hub_fingerprint": corpus.hub_fingerprint,
            "revision": corpus.revision,
        },
        "skipped": corpus.skipped,
        "replaced_sequences": corpus.replaced_sequences,
        "tokenizer": {"trained": trained, "path": tok_cfg.path},
    }


def stage_output(corpus: Corpus, data: DataConfig, meta: dict[str, Any], seconds: dict[str, float]) -> StageOutput:
    """The stage's metrics, files, MLflow artifacts and dataset input."""
    stats = meta["splits"]
    total_tokens = sum(int(s["tokens"]) for s in stats.values())
    encode_seconds = seconds["encode_seconds"]
    metrics = {
        "docs_train": stats["train"]["docs"],
        "docs_val": stats["val"]["docs"],
        "bytes_train": stats["train"]["bytes"],
        "bytes_val": stats["val"]["bytes"],
        "tokens_train": stats["train"]["tokens"],
        "tokens_val": stats["val"]["tokens"],
        "vocab_size": meta["vocab_size"],
        "tokens_per_s": round(total_tokens / encode_seconds, 1) if encode_seconds > 0 else 0.0,
        "bytes_per_token": meta["bytes_per_token"],
        "skipped_files": len(corpus.skipped),
        "replaced_sequences": corpus.replaced_sequences,
        **{name: round(value, 3) for name, value in seconds.items()},
    }
    return StageOutput(
        metrics=metrics,
        files={"tokenizer": "tokenizer.json", "train": "train.bin", "val": "val.bin", "meta": "meta.json"},
        artifacts=["tokenizer.json", "meta.json"],
        dataset={
            "kind": corpus.kind,
            "source": corpus.source,
            "digest": corpus.fingerprint[:32],
            "name": Path(corpus.source).name if corpus.kind != "hub" else corpus.source,
            "hf_subset": data.hf_subset,
            "hf_split": data.hf_split,
            "revision": corpus.revision,
        },
        info={
            **({"revision": corpus.revision} if corpus.revision else {}),  # the hub dataset's commit it read
            "skipped": corpus.skipped[:50],
            "dtype": meta["dtype"],
            "eod_id": meta["eod_id"],
        },
    )
