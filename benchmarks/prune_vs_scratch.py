"""Prune + distill vs the same small architecture trained from scratch on the same compute.

    cpuforge run --profile demo --set prune.keep_ratio=0.5 --summary demo.json
    python benchmarks/prune_vs_scratch.py demo.json

Compute is counted in training FLOPs: the teacher's pretraining (tokens x its FLOPs/token) plus
recovery (tokens x (student FLOPs/token + a teacher forward, 1/3 of its training FLOPs/token)).
With --sunk-teacher only the recovery counts (the teacher exists already, as in Minitron).
The scratch model gets the same FLOPs as a token budget, the same data, schedule shape and
seed, and both are scored on the same val batches. Goal: prune + distill wins.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from cpuforge.models.checkpoint import load_model
from cpuforge.models.llama import Llama, flops_per_token, param_count
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.data import open_shards, token_byte_lengths, val_batches
from cpuforge.tasks.engine.hardware import available_cores
from cpuforge.tasks.engine.trainer import train
from cpuforge.tasks.engine.validation import evaluate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("summary", help="summary JSON of a cpuforge run that went through recover")
    parser.add_argument("--workdir", help="where to train the scratch model (default: next to the run)")
    parser.add_argument("--sunk-teacher", action="store_true",
                        help="count only the recovery compute (Minitron's setting: the big model already exists)")
    args = parser.parse_args()

    summary = json.loads(Path(args.summary).read_text())
    stages = summary["stages"]
    cfg = load_config(config_file=Path(summary["run_dir"]) / "config.yaml")
    teacher = load_model(Path(stages["pretrain"]["output_dir"]) / "model")
    recovered = load_model(Path(stages["recover"]["output_dir"]) / "model")
    shards = open_shards(Path(stages["tokenize"]["output_dir"]), teacher.cfg.block_size)
    lengths = token_byte_lengths(shards.tokenizer_path)
    val = val_batches(shards.val, cfg.train.eval_batches, cfg.train.batch_size, teacher.cfg.block_size)

    f_teacher, f_student = flops_per_token(teacher.cfg), flops_per_token(recovered.cfg)
    pre_tokens, rec_tokens = stages["pretrain"]["metrics"]["tokens"], stages["recover"]["metrics"]["tokens"]
    flops = rec_tokens * (f_student + f_teacher / 3) + (0 if args.sunk_teacher else pre_tokens * f_teacher)
    scratch_tokens = int(flops / f_student)

    torch.set_num_threads(available_cores())
    torch.manual_seed(cfg.train.seed)
    scratch = Llama(recovered.cfg)
    s = cfg.train.model_copy(update={"max_minutes": None, "max_steps": None, "max_tokens": scratch_tokens})
    workdir = Path(args.workdir or Path(summary["workdir"]) / ("bench-scratch-sunk" if args.sunk_teacher else "bench-scratch"))
    print(f"student: {param_count(recovered):,} params; teacher: {param_count(teacher):,}")
    counted = "recovery only (teacher sunk)" if args.sunk_teacher else f"teacher pretraining {pre_tokens:,} tokens + recovery"
    print(f"compute: {flops / 1e12:.2f} TFLOP = {counted} ({rec_tokens:,} recovery tokens); "
          f"scratch gets {scratch_tokens:,} tokens")
    result = train(scratch, shards.train, val, lengths, s, workdir / "checkpoints")
    _, bpb_recovered = evaluate(recovered, val, lengths)
    _, bpb_teacher = evaluate(teacher, val, lengths)
    print(f"val bits per byte (same {sum(x.numel() for x, _ in val):,} val tokens):")
    print(f"  teacher (unpruned):              {bpb_teacher:.4f}")
    print(f"  pruned, right after pruning:     {stages['prune']['metrics']['val_bpb_after']:.4f}")
    print(f"  pruned + distilled:              {bpb_recovered:.4f}")
    print(f"  same architecture from scratch:  {result.val_bpb:.4f}  ({result.tokens:,} tokens)")
    winner = "prune + distill" if bpb_recovered < result.val_bpb else "from scratch"
    print(f"winner: {winner} (by {abs(result.val_bpb - bpb_recovered):.4f} bits per byte)")


if __name__ == "__main__":
    main()
