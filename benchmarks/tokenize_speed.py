"""Tokenize-stage encoding speed vs `tokenizers`' own encode_batch, on the same text, in one run.

    python benchmarks/tokenize_speed.py [--profile demo] [--set data.source=...] [--repeats 3]

Prints tokens/s of: raw `Tokenizer.encode_batch` over all documents (the reference),
raw `encode_batch_fast` (no offsets), and cpuforge's `encode_to_shard` (batched encode
plus writing the uint16/uint32 shard). Best of N repeats each, interleaved so machine noise
hits all three alike. Goal: cpuforge >= 0.8x the reference.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.data.corpus import load_corpus
from cpuforge.tasks.data.encoding import encode_to_shard, shard_dtype
from cpuforge.tasks.stages.tokenize import chunk_documents, train_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="demo")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    cfg = load_config(args.profile, overrides=args.overrides)
    with tempfile.TemporaryDirectory() as tmp:
        docs = chunk_documents(load_corpus(cfg.data, Path(tmp)).docs, cfg.data.chunk_bytes, cfg.data.min_docs)
        n_bytes = sum(len(d.encode()) for d in docs)
        t0 = time.perf_counter()
        tokenizer = train_tokenizer(docs, cfg.tokenizer)
        print(f"corpus: {len(docs)} docs, {n_bytes / 1e6:.1f} MB; tokenizer (vocab "
              f"{tokenizer.get_vocab_size()}) trained in {time.perf_counter() - t0:.1f}s")
        eod = tokenizer.token_to_id(cfg.tokenizer.eod_token)
        dtype = shard_dtype(tokenizer.get_vocab_size())

        def reference() -> int:
            return sum(len(e.ids) for e in tokenizer.encode_batch(docs, add_special_tokens=False))

        def reference_fast() -> int:
            return sum(len(e.ids) for e in tokenizer.encode_batch_fast(docs, add_special_tokens=False))

        def cpuforge() -> int:
            return encode_to_shard(tokenizer, docs, eod, dtype, Path(tmp) / "train.bin") - len(docs)

        best: dict[str, float] = {}
        for _ in range(args.repeats):
            for name, fn in (("encode_batch", reference), ("encode_batch_fast", reference_fast), ("cpuforge", cpuforge)):
                t0 = time.perf_counter()
                tokens = fn()
                best[name] = max(best.get(name, 0.0), tokens / (time.perf_counter() - t0))
    for name, rate in best.items():
        print(f"{name:>18}: {rate / 1e6:6.3f} M tokens/s")
    print(f"ratio cpuforge / encode_batch: {best['cpuforge'] / best['encode_batch']:.2f} (goal >= 0.80)")


if __name__ == "__main__":
    main()
