"""Pruned widths on a grid of 8 or 32: quality right after pruning and after the same recovery.

    cpuforge run --summary demo.json          # any run that went through pretrain
    python benchmarks/prune_widths.py demo.json --multiples 8,32 --recover-steps 150

prune.width_multiple=32 keeps every matrix row in whole 32-value blocks (llama.cpp's Q8_0, ONNX's
MatMulNBits), at the price of a coarser grid: a 128-wide embedding halves to 64, and the MLP then
takes what the parameter budget leaves. This prunes the run's pretrained model at each multiple
(the run's prune settings otherwise), distils each student from the same teacher for the same
number of steps (recover's settings, max_steps fixed so that load on the machine changes nothing)
and scores both on the same validation batches.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

from cpuforge.models.checkpoint import load_model
from cpuforge.models.llama import param_count
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.data import open_shards, token_byte_lengths, val_batches
from cpuforge.tasks.engine.hardware import available_cores
from cpuforge.tasks.engine.losses import distillation_loss
from cpuforge.tasks.engine.trainer import train
from cpuforge.tasks.engine.training_run import recover_train_config
from cpuforge.tasks.engine.validation import evaluate
from cpuforge.tasks.infra.store import StageRecord
from cpuforge.tasks.stages.prune import prune_stage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("summary", help="summary JSON of a cpuforge run that went through pretrain")
    parser.add_argument("--multiples", default="8,32")
    parser.add_argument("--recover-steps", type=int, default=150)
    args = parser.parse_args()

    summary = json.loads(Path(args.summary).read_text())
    stages = summary["stages"]
    cfg = load_config(config_file=Path(summary["run_dir"]) / "config.yaml")
    tokenized = StageRecord(stage="tokenize", key="bench", output_dir=stages["tokenize"]["output_dir"])
    pretrained = StageRecord(stage="pretrain", key="bench", output_dir=stages["pretrain"]["output_dir"],
                             files={"model": "model", "tokenizer": "model/tokenizer.json"})
    teacher = load_model(pretrained.path("model")).eval()
    shards = open_shards(Path(tokenized.output_dir), teacher.cfg.block_size)
    lengths = token_byte_lengths(shards.tokenizer_path)
    val = val_batches(shards.val, cfg.train.eval_batches, cfg.train.batch_size, teacher.cfg.block_size)
    torch.set_num_threads(available_cores())
    r = cfg.recover
    s = recover_train_config(cfg.train, r).model_copy(update={
        "max_steps": args.recover_steps, "max_minutes": None, "max_tokens": None, "eval_interval": 10**9,
        "checkpoint_every_steps": 10**9, "checkpoint_every_minutes": 10**9})
    print(f"teacher {param_count(teacher):,} params, {teacher.cfg.d_model}/{teacher.cfg.d_mlp} x {teacher.cfg.n_layer}; "
          f"val bpb {evaluate(teacher, val, lengths)[1]:.4f}; recover {args.recover_steps} steps of "
          f"{s.batch_size}x{teacher.cfg.block_size}")
    with tempfile.TemporaryDirectory() as tmp:
        for multiple in (int(m) for m in args.multiples.split(",")):
            out = Path(tmp) / f"m{multiple}"
            p = cfg.prune.model_copy(update={"width_multiple": multiple})
            pruned = prune_stage(p, tokenized, pretrained, out)
            student = load_model(out / "model")
            result = train(student, shards.train, val, lengths, s, out / "checkpoints",
                           loss_fn=distillation_loss(teacher, r.temperature, r.kd_weight, r.lm_weight))
            m = pruned.metrics
            print(f"width_multiple {multiple:3d}: {m['d_model_after']}/{m['d_mlp_after']} x {m['n_layer_after']}, "
                  f"{m['params_after']:,} params ({m['keep_ratio_actual']:.3f}); val bpb after pruning "
                  f"{m['val_bpb_after']:.4f}, after recovery {result.val_bpb:.4f}", flush=True)
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
