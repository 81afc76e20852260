"""The deployable model against where it started: final int8 ONNX vs the unpruned PyTorch fp32 model.

    cpuforge run --profile demo --summary demo.json
    python benchmarks/deploy_speedup.py demo.json [--rounds 5]

Each timing round runs each model in a fresh process of its own (as deployed: one model per
process; two runtimes' thread pools in one process spin against each other on a small
machine), alternating the models round after round with the same threads and the same random
full-context batches; each figure is the best round (noise on a shared machine only ever
slows a round down). Decode: greedy tokens/s at batch 1 with the KV cache (the way each runtime
generates: PyTorch with its cache, onnxruntime through I/O binding). Quality: bits per byte of
both on the same validation tokens (the evaluate stage's). Goals (issue 15): prefill tokens/s at
least 4x, decode tokens/s at least 10x, bits per byte within +2% of the unpruned model's, and
the file at least 6x smaller.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from cpuforge.models.runtime import load_language_model
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.data import open_shards, token_byte_lengths
from cpuforge.tasks.engine.hardware import available_cores, cpu_model, int8_dot_product
from cpuforge.tasks.engine.scoring import decode_tokens_per_s, prefill_tokens_per_s, score_tokens

GOALS = {"prefill_speedup": 4.0, "decode_speedup": 10.0, "size_ratio": 6.0, "bpb_increase_pct": 2.0}


def time_one(path: str, batches: list[int], decode: int) -> None:
    """Child mode: time one model alone in this process and print the figures as JSON."""
    threads = available_cores()
    torch.set_num_threads(threads)
    lm = load_language_model(Path(path), threads=threads)
    figures = {f"prefill_tok_s_b{b}": round(prefill_tokens_per_s(lm, batch=b, repeats=3), 1) for b in batches}
    figures["decode_tok_s"] = round(decode_tokens_per_s(lm, decode), 1)
    print(json.dumps(figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("summary", nargs="?", help="summary JSON of a cpuforge run that went through quantize")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds (a process per model each)")
    parser.add_argument("--time", help=argparse.SUPPRESS)  # child mode: the model to time
    parser.add_argument("--batches", type=int, nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--decode", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.time:
        return time_one(args.time, args.batches, args.decode)
    if not args.summary:
        parser.error("give the summary JSON of a cpuforge run")

    summary = json.loads(Path(args.summary).read_text())
    stages = summary["stages"]
    cfg = load_config(summary["profile"])
    threads = available_cores()
    models = {"pytorch fp32 (unpruned)": load_language_model(Path(stages["pretrain"]["output_dir"]) / "model"),
              "onnx int8 (final)": load_language_model(Path(stages["quantize"]["output_dir"]) / "model.int8.onnx")}
    shards = open_shards(Path(stages["tokenize"]["output_dir"]), 2)
    val = np.asarray(shards.val[: cfg.eval.max_tokens + 1])
    lengths = token_byte_lengths(shards.tokenizer_path)

    rows = {name: {"params": lm.params, "file_bytes": lm.file_bytes,
                   "val_bpb": score_tokens(lm, val, lengths).val_bpb} for name, lm in models.items()}
    for _ in range(args.rounds):
        for name, lm in models.items():
            timing = json.loads(subprocess.run(
                [sys.executable, __file__, "--time", str(lm.path), "--batches", *map(str, cfg.eval.batch_sizes),
                 "--decode", str(cfg.eval.decode_tokens)], capture_output=True, text=True, check=True).stdout)
            for key, value in timing.items():
                rows[name][key] = max(rows[name].get(key, 0.0), value)
    base, final = rows["pytorch fp32 (unpruned)"], rows["onnx int8 (final)"]
    b0 = cfg.eval.batch_sizes[0]
    result = {
        "prefill_speedup": {f"b{b}": round(final[f"prefill_tok_s_b{b}"] / base[f"prefill_tok_s_b{b}"], 2)
                            for b in cfg.eval.batch_sizes},
        "decode_speedup": round(final["decode_tok_s"] / base["decode_tok_s"], 2),
        "size_ratio": round(base["file_bytes"] / final["file_bytes"], 2),
        "bpb_increase_pct": round(100 * (final["val_bpb"] / base["val_bpb"] - 1), 2),
    }
    met = {
        "prefill_speedup": result["prefill_speedup"][f"b{b0}"] >= GOALS["prefill_speedup"],
        "decode_speedup": result["decode_speedup"] >= GOALS["decode_speedup"],
        "size_ratio": result["size_ratio"] >= GOALS["size_ratio"],
        "bpb_increase_pct": result["bpb_increase_pct"] <= GOALS["bpb_increase_pct"],
    }
    chosen = Path(stages["quantize"]["output_dir"]) / "candidates.json"  # quantize's report: which candidate
    kept = json.loads(chosen.read_text()) if chosen.is_file() else {}
    print(f"CPU: {cpu_model()}, {threads} threads, int8 dot product: {int8_dot_product()}; "
          f"{len(val) - 1:,} val tokens; final model: {kept.get('kept_is') or kept.get('kept') or 'model.int8.onnx'}")
    for name, row in rows.items():
        print(f"{name:24s} " + "  ".join(f"{k}={v:,}" if isinstance(v, int) else f"{k}={v:g}" for k, v in row.items()))
    print(json.dumps({"models": rows, "ratios": result, "goals": GOALS, "goal_met": met}, indent=2))


if __name__ == "__main__":
    main()
