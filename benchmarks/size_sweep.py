"""Model size vs validation bits per byte at equal wall-clock: where is the tokens-per-parameter sweet spot?

    nice python benchmarks/size_sweep.py [--minutes 5] [--threads 2] [--shapes 0,1,2,3,4,5] [--tokenized DIR]

Method. Every shape of models/config.py AUTO_LADDER (up to --max-shapes; the demo's vocabulary 4096 and
context 256, heads of 64) is trained on the demo corpus (stdlib) with the demo profile's recipe, for the
number of tokens that --minutes of training buys THAT shape on this machine when it is not disturbed.
A literal wall-clock race would measure whatever else the shared machine runs at the time, so:
 1. each shape's training tokens/s is measured in one process, a few real steps each, round-robin across
    the shapes, best of --rounds (the demo shape is among them: it is the anchor the others are compared to;
   on a machine too busy to measure idle speed, --anchor-tok-s scales every rate so the demo's is its idle one);
 2. its token budget is --minutes x 60 x that rate, and it trains with train.max_tokens = that budget (so
    the cosine schedule ends exactly with the budget however busy the machine is while it trains);
 3. every model is scored on the same --val-batches validation batches (bits per byte).
The table gives params, tokens/s, tokens, tokens per parameter and val bpb per shape; the shape with the
lowest bpb marks the sweet spot, and its tokens/param is what `model.size: auto` aims at
(tasks/engine/sizing.py TOKENS_PER_PARAM). Threads: --threads (default 2), said in the output. Steps are
timed and trained in the dtype the demo profile's sizing times (sizing.training_dtype: bf16 autocast where
the CPU has native bf16, else fp32), with the demo's optimizer.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from cpuforge.models.config import AUTO_LADDER, LlamaConfig, ladder_shape
from cpuforge.models.llama import Llama, config_param_count
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.data import open_shards, token_byte_lengths, val_batches
from cpuforge.tasks.engine.sizing import measure_shapes, training_dtype
from cpuforge.tasks.engine.trainer import RunFacts, train
from cpuforge.tasks.engine.validation import evaluate
from cpuforge.tasks.stages.tokenize import tokenize


def non_embedding(cfg: LlamaConfig) -> int:
    return config_param_count(cfg) - cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0, help="wall-clock budget each shape's tokens stand for")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", default="0,1,2,3,4,5", help="indices into AUTO_LADDER")
    parser.add_argument("--rounds", type=int, default=3, help="timed steps per shape (best of)")
    parser.add_argument("--val-batches", type=int, default=32)
    parser.add_argument("--anchor-tok-s", type=float,
                        help="the demo shape's training tok/s on this machine when idle: every measured rate is scaled "
                             "by it / the demo's measured rate (relative speeds still come from the alternating "
                             "measurement); for a machine too busy to measure idle speed at all")
    parser.add_argument("--tokenized", help="a demo tokenize stage's folder to reuse (default: tokenize here)")
    parser.add_argument("--workdir", help="where to tokenize and checkpoint (default: a temporary folder)")
    args = parser.parse_args()

    cfg = load_config("demo")
    dtype = training_dtype(cfg.train.precision)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        tok = Path(args.tokenized) if args.tokenized else root / "tok"
        if not args.tokenized:
            tok.mkdir(parents=True, exist_ok=True)
            tokenize(cfg.data, cfg.tokenizer, tok, root / "cache")
        shards = open_shards(tok, cfg.model.block_size)
        lengths = token_byte_lengths(shards.tokenizer_path)
        val = val_batches(shards.val, args.val_batches, cfg.train.batch_size, cfg.model.block_size)
        demo = LlamaConfig.named("demo", shards.vocab_size)
        shapes = [replace(demo, **ladder_shape(*AUTO_LADDER[int(i)])) for i in args.shapes.split(",")]
        if demo not in shapes:
            shapes.append(demo)

        rates = measure_shapes(shapes, cfg.train.batch_size, args.threads, dtype, rounds=args.rounds,
                               optimizer=cfg.train.optimizer_in_use())
        demo_rate = rates[shapes.index(demo)]
        print(f"{args.threads} threads, {dtype}, batch {cfg.train.batch_size}x{demo.block_size}, vocab {demo.vocab_size}; "
              f"budget {args.minutes:g} min at each shape's measured tok/s (best of {args.rounds}, round-robin); "
              f"demo shape measured {demo_rate:,.0f} tok/s", flush=True)
        if args.anchor_tok_s:
            rates = [r * args.anchor_tok_s / demo_rate for r in rates]
            print(f"rates scaled to the demo shape's idle {args.anchor_tok_s:,.0f} tok/s (--anchor-tok-s): "
                  + ", ".join(f"{config_param_count(s) / 1e6:.2f}M {r:,.0f}" for s, r in zip(shapes, rates)), flush=True)
        rows = []
        for i, (shape, rate) in enumerate(zip(shapes, rates)):
            budget = int(args.minutes * 60 * rate)
            s = cfg.train.model_copy(update={"max_minutes": None, "max_steps": None, "max_tokens": budget,
                                             "eval_interval": 10**9, "checkpoint_every_steps": 10**9,
                                             "checkpoint_every_minutes": 10**6})
            torch.manual_seed(cfg.train.seed)
            model = Llama(shape)
            t0 = time.perf_counter()
            result = train(model, shards.train, val[:1], lengths, s, root / f"ckpt{i}", RunFacts(dtype))
            _, bpb = evaluate(model, val, lengths, dtype)
            params = config_param_count(shape)
            rows.append({"d_model": shape.d_model, "n_layer": shape.n_layer, "n_head": shape.n_head,
                         "n_kv_head": shape.n_kv_head, "d_mlp": shape.d_mlp, "params": params,
                         "non_embedding": non_embedding(shape), "tok_s": rate, "tokens": result.tokens,
                         "tokens_per_param": result.tokens / params, "val_bpb": bpb,
                         "wall_s": time.perf_counter() - t0, "demo": shape == demo})
            print(json.dumps(rows[-1]), flush=True)

    best = min(rows, key=lambda r: r["val_bpb"])
    demo_row = next(r for r in rows if r["demo"])
    print("\n| shape (d_model x layers, heads/kv, mlp) | params | non-emb | tok/s | tokens | tokens/param | val bpb "
          "| vs demo | wall s |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mark = " (demo)" if r["demo"] else ""
        print(f"| {r['d_model']}x{r['n_layer']}, {r['n_head']}/{r['n_kv_head']}, {r['d_mlp']}{mark} | "
              f"{r['params'] / 1e6:.2f}M | {r['non_embedding'] / 1e6:.2f}M | {r['tok_s']:,.0f} | {r['tokens']:,} | "
              f"{r['tokens_per_param']:.1f} | {r['val_bpb']:.4f} | {r['val_bpb'] / demo_row['val_bpb'] - 1:+.1%} | "
              f"{r['wall_s']:.0f} |")
    print(f"lowest val bpb: {best['params'] / 1e6:.2f}M params at {best['tokens_per_param']:.1f} tokens/param "
          f"({best['val_bpb']:.4f} vs the demo shape's {demo_row['val_bpb']:.4f}, "
          f"{best['val_bpb'] / demo_row['val_bpb'] - 1:+.1%}); {args.minutes:g}-minute budget, {args.threads} threads")


if __name__ == "__main__":
    main()
