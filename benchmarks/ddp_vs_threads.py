"""On this machine: is 2 processes x 1 thread (DDP over gloo) faster than 1 process x 2 threads?

    python benchmarks/ddp_vs_threads.py [--profile demo] [--steps 30]

Tokenizes the profile's corpus once, then trains the profile's model for the same number of
steps both ways (global batch equal: each DDP rank takes half the batch) and prints the
median tokens/s of each (first steps skipped) and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from launch_training import train_standalone  # benchmarks/ sibling

from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.hardware import available_cores
from cpuforge.tasks.stages.tokenize import tokenize

WARMUP_STEPS = 5


def median_rate(out_dir: Path) -> float:
    history = [json.loads(line) for line in (out_dir / "history.jsonl").read_text().splitlines()]
    return statistics.median(h["tokens_per_s"] for h in history[WARMUP_STEPS:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="demo")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    cores = available_cores()
    base = ["train.max_minutes=null", f"train.max_steps={args.steps}", f"train.eval_interval={args.steps}",
            f"train.checkpoint_every_steps={args.steps}"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "tok").mkdir()
        cfg = load_config(args.profile)
        tokenize(cfg.data, cfg.tokenizer, root / "tok", root / "cache")
        batch = load_config(args.profile).train.batch_size
        cases = {
            f"1 process x {cores} threads": ([*base, f"train.threads={cores}"], 1),
            f"{cores} processes x 1 thread": ([*base, "train.threads=1", f"train.nproc_per_node={cores}",
                                               f"train.batch_size={batch // cores}"], cores),
        }
        rates = {}
        for name, (overrides, world) in cases.items():
            cfg = load_config(args.profile, overrides=overrides)
            out = train_standalone(cfg, root / "tok", root / name.replace(" ", "_"), world)
            rates[name] = median_rate(out)
    for name, rate in rates.items():
        print(f"{name:>26}: {rate:8.0f} tokens/s")
    (one, many) = rates.values()
    print(f"ratio DDP / threads: {many / one:.2f} (> 1 means more processes win on this machine)")


if __name__ == "__main__":
    main()
