"""Encoding tokens/s of the tokenize stage's runners on the same corpus, in one run.

    python benchmarks/tokenize_parallel.py [--copies 8] [--piece-mb 8] [--workers 0] [--repeats 2]

The corpus is the embedded one (the standard library) repeated --copies times, as a stand-in for
a big corpus. The tokenizer is trained once, then the train split is encoded by: this process
(`single`: the Rust tokenizer's own threads), a local process pool (`process`: a Prefect task per
piece), and a local Dask cluster through prefect-dask (`dask`). Each result is checked to be
byte-identical to `single`. Timings include starting the workers (and the Dask cluster),
shipping the pieces and joining them. Best of --repeats, runners interleaved.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from cpuforge.flows.cli import apply_prefect_defaults

apply_prefect_defaults()

from cpuforge.tasks.config.settings import load_config  # noqa: E402
from cpuforge.tasks.data.corpus import load_corpus  # noqa: E402
from cpuforge.tasks.data.encoding import encode_to_shard, shard_dtype
from cpuforge.tasks.data.parallel_encode import encode_pieces, split_into_pieces, task_runner  # noqa: E402
from cpuforge.tasks.stages.tokenize import chunk_documents, train_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=8, help="times the stdlib corpus is repeated")
    parser.add_argument("--piece-mb", type=float, default=8.0, help="characters per piece, in millions")
    parser.add_argument("--workers", type=int, default=0, help="processes (0 = the cores available)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    cfg = load_config("demo", overrides=[f"data.encode_workers={args.workers}",
                                         f"data.piece_bytes={int(args.piece_mb * 1e6)}"])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        docs = chunk_documents(load_corpus(cfg.data, tmp).docs, cfg.data.chunk_bytes, cfg.data.min_docs)
        tokenizer = train_tokenizer(docs, cfg.tokenizer)
        docs = docs * args.copies
        eod = tokenizer.token_to_id(cfg.tokenizer.eod_token)
        dtype = shard_dtype(tokenizer.get_vocab_size())
        pieces = split_into_pieces(docs, cfg.data.piece_bytes)
        workers = cfg.data.encode_workers or os.cpu_count()
        print(f"corpus: {len(docs):,} docs, {sum(len(d) for d in docs) / 1e6:.0f} M characters; {len(pieces)} "
              f"pieces; {workers} workers on {os.cpu_count()} cores")

        def single(out: Path) -> int:
            return encode_to_shard(tokenizer, docs, eod, dtype, out)

        def pooled(kind: str):
            def run(out: Path) -> int:
                data = cfg.data.model_copy(update={"encode_runner": kind})
                return encode_pieces(task_runner(data, len(pieces)), tokenizer.to_str(), pieces, eod, dtype, out)
            return run

        runners = {"single": single, "process": pooled("process"), "dask": pooled("dask")}
        best = {name: float("inf") for name in runners}
        tokens = 0
        for _ in range(args.repeats):
            for name, run in runners.items():
                out = tmp / f"{name}.bin"
                t0 = time.perf_counter()
                tokens = run(out)
                best[name] = min(best[name], time.perf_counter() - t0)
        reference = (tmp / "single.bin").read_bytes()
        for name in ("process", "dask"):
            same = (tmp / f"{name}.bin").read_bytes() == reference
            assert same, f"{name} wrote different shards"


    print(f"{tokens:,} tokens; shards byte-identical across runners")
    print("| runner | seconds | tokens/s | vs single |")
    print("|---|---|---|---|")
    for name, seconds in best.items():
        print(f"| {name} | {seconds:.1f} | {tokens / seconds:,.0f} | {best['single'] / seconds:.2f}x |")


if __name__ == "__main__":
    main()
