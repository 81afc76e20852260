"""Training throughput and memory per process, one process vs DDP vs FSDP, on this machine, in one run.

    python benchmarks/scaling.py [--size small] [--processes 2] [--steps 8] [--batch 4]

Trains the same model (a named size from models/config.py, vocabulary of the demo tokenizer)
for the same steps and global batch: 1 process x all cores, then N processes x 1 thread with
DDP and with FSDP (torchrun, gloo, loopback). Prints the median tokens/s (first steps skipped),
the speedup and efficiency per process (speedup / N), and the peak RSS of rank 0 during training
steps and including its checkpoints (full state from one process or DDP, shards from FSDP). From
the measured bytes per parameter of each it estimates the largest model whose optimizer steps
fit 24 GiB per machine (an estimate: only the sizes above were run). On N machines, FSDP
divides the sharded state by every process of every machine; DDP never does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from launch_training import train_standalone  # benchmarks/ sibling

from cpuforge.models.config import SIZES
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.hardware import available_cores
from cpuforge.tasks.stages.tokenize import tokenize

WARMUP_STEPS = 2
BUDGET_GIB = 24


def baseline_rss_mb() -> float:
    """Peak RSS of a process that imported the training code but built no model."""
    code = "import torch, tasks.training_run; from cpuforge.tasks.engine.hardware import peak_rss_mb; print(peak_rss_mb())"
    return float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)


def run(root: Path, name: str, overrides: list[str], world: int) -> dict:
    out = train_standalone(load_config("demo", overrides=overrides), root / "tok", root / name, world)
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    result = json.loads((out / "result.json").read_text())
    return {"tok_s": statistics.median(h["tokens_per_s"] for h in history[WARMUP_STEPS:]),
            "rss_mb": history[-1]["peak_rss_mb"], "rss_with_checkpoint_mb": result["peak_rss_mb"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences per step)")
    parser.add_argument("--block", type=int, default=256)
    args = parser.parse_args()
    cores, n = available_cores(), args.processes
    dims = {k: v for k, v in SIZES[args.size].items() if k != "block_size"}
    base = [f"model.{k}={v}" for k, v in dims.items()] + [
        f"model.block_size={args.block}", "train.max_minutes=null", f"train.max_steps={args.steps}",
        f"train.eval_interval={args.steps}", "train.eval_batches=1", f"train.checkpoint_every_steps={10 * args.steps}"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "tok").mkdir()
        demo = load_config("demo")
        tokenize(demo.data, demo.tokenizer, root / "tok", root / "cache")
        vocab = json.loads((root / "tok" / "meta.json").read_text())["vocab_size"]
        from cpuforge.models.config import LlamaConfig
        from cpuforge.models.llama import config_param_count

        params = config_param_count(LlamaConfig(vocab_size=vocab, block_size=args.block, **dims))
        cases = {
            f"1 process x {cores} threads": ([*base, f"train.threads={cores}", f"train.batch_size={args.batch}"], 1),
            f"DDP, {n} processes x 1 thread": ([*base, "train.threads=1", f"train.nproc_per_node={n}",
                                                f"train.batch_size={args.batch // n}"], n),
            f"FSDP, {n} processes x 1 thread": ([*base, "train.threads=1", f"train.nproc_per_node={n}",
                                                 "train.strategy=fsdp", f"train.batch_size={args.batch // n}"], n),
        }
        results = {name: run(root, f"case{i}", overrides, world)
                   for i, (name, (overrides, world)) in enumerate(cases.items())}

    baseline = baseline_rss_mb()
    one = next(iter(results.values()))
    print(f"model: {args.size}, {params / 1e6:.1f}M params, block {args.block}, global batch {args.batch}; {cores} cores; "
          f"a process without a model: {baseline:.0f} MB")
    print("| setup | tokens/s | speedup | efficiency per process | peak RSS per process, training | bytes/param | "
          f"largest model in {BUDGET_GIB} GiB per machine (est.) | peak RSS of rank 0 with a checkpoint |")
    print("|---|---|---|---|---|---|---|---|")
    for (name, r), world in zip(results.items(), (1, n, n)):
        speedup = r["tok_s"] / one["tok_s"]
        per_param = (r["rss_mb"] - baseline) * 2**20 / params
        largest = (BUDGET_GIB * 2**30 / world - baseline * 2**20) / per_param
        print(f"| {name} | {r['tok_s']:,.0f} | {speedup:.2f}x | {speedup / world:.0%} | {r['rss_mb'] / 1024:.2f} GiB | "
              f"{per_param:.1f} | {largest / 1e9:.2f}B params | {r['rss_with_checkpoint_mb'] / 1024:.2f} GiB |")


if __name__ == "__main__":
    main()
