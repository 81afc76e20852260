"""The prune stage at a real model size: seconds and peak RSS of `prune_stage` on a random-init Llama of a given
shape (default SmolLM2-135M's: 30 x 576, 9 heads / 3 KV, MLP 1536, vocabulary 49,152, tied), on random token
shards, with a profile's prune settings. Speed only: importance on random weights and tokens means nothing.

    python benchmarks/prune_at_size.py --profile demo
    python benchmarks/prune_at_size.py --layers 22 --d-model 2048 --heads 32 --kv-heads 4 --mlp 5632 --vocab 32000

Run it alone: a second process on 2 cores halves the figure.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from cpuforge.models.checkpoint import save_model
from cpuforge.models.config import LlamaConfig
from cpuforge.models.llama import Llama, param_count
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.hardware import cpu_model, peak_rss_mb, reset_peak_rss
from cpuforge.tasks.infra.store import StageRecord
from cpuforge.tasks.stages.prune import prune_stage


def token_shards(folder: Path, vocab: int, tokens: int) -> None:
    """train.bin / val.bin of random ids, a word-level tokenizer of `vocab` entries, meta.json."""
    folder.mkdir(parents=True)
    eod = vocab - 1
    words = {f"w{i}": i for i in range(vocab - 1)} | {"<|endoftext|>": eod}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    rng = np.random.default_rng(0)
    dtype = np.uint16 if vocab <= 65535 else np.uint32
    for split, n in (("train", tokens), ("val", tokens // 4)):
        rng.integers(0, vocab, n, dtype=np.int64).astype(dtype).tofile(folder / f"{split}.bin")
    (folder / "meta.json").write_text(json.dumps({"vocab_size": vocab, "dtype": np.dtype(dtype).name, "eod_id": eod,
                                                  "eod_token": "<|endoftext|>"}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="demo")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--d-model", type=int, default=576)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--mlp", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--context", type=int, default=256, help="the profile's context (an adopted model's is cut to it)")
    args = ap.parse_args()
    cfg = LlamaConfig(vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, n_kv_head=args.kv_heads,
                      d_model=args.d_model, d_mlp=args.mlp, block_size=args.context, tie_embeddings=True)
    p = load_config(args.profile).prune
    with tempfile.TemporaryDirectory(prefix="cpuforge-prune-at-size-") as tmp:
        root = Path(tmp)
        token_shards(root / "tok", args.vocab, 64 * args.context * p.batch_size)
        torch.manual_seed(0)
        model = Llama(cfg)
        params = param_count(model)
        save_model(model, root / "pre" / "model")
        del model
        tok = StageRecord(stage="tokenize", key="t", output_dir=str(root / "tok"))
        pre = StageRecord(stage="pretrain", key="p", output_dir=str(root / "pre"),
                          files={"model": "model", "tokenizer": str(root / "tok" / "tokenizer.json")})
        (root / "out").mkdir()
        reset_peak_rss()
        started = time.perf_counter()
        out = prune_stage(p, tok, pre, root / "out")
        seconds = time.perf_counter() - started
    print(json.dumps({"cpu": cpu_model(), "threads": torch.get_num_threads(), "params": params,
                      "params_after": out.metrics["params_after"], "strategy": p.strategy,
                      "forward_batches": 2 * p.val_batches + p.calib_batches, "batch": p.batch_size,
                      "context": args.context, "seconds": round(seconds, 1), "peak_rss_mb": round(peak_rss_mb())}))


if __name__ == "__main__":
    main()
