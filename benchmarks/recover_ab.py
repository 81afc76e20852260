"""The recovery A/B: val bits per byte of the pruned model after the same distillation steps, per recipe.

    cpuforge run --profile demo --summary demo.json
    nice python benchmarks/recover_ab.py demo.json --arms lr=5e-4 lr=2e-3 lr=4e-3 "lr=4e-3 lm_weight=0"
    python benchmarks/recover_ab.py demo.json --arms optimizer=adamw "optimizer=muon muon_lr=2e-3" \
        "optimizer=muon muon_lr=4e-3"

Every arm starts from the run's pruned model (its prune stage), distils the run's unpruned model
(its pretrain stage) on the run's tokens, and trains exactly --steps optimizer steps (default: the
steps the run's recover stage took in its budget), so the arms compare at the same work whatever
the machine's load; they differ only in the recover settings they name (RecoverConfig's keys: lr,
temperature, kd_weight, lm_weight, optimizer, muon_lr; the rest is the run's; '' is the run's own
settings). Each arm trains in the precision the run's recover stage trained in, with the run's
threads per process, and the teacher and every arm are then scored in fp32 on the run's validation
batches, as the deploy goal compares them. The gap to the teacher is the bits-per-byte cost of pruning that issue
15's deploy goal (+2% at most) measures. Unlike the stage, the cosine decay spans exactly --steps
(the stage estimates its horizon from the clock), one process trains, and train.compile is not used.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from cpuforge.models.checkpoint import load_model
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.data import open_shards, token_byte_lengths, val_batches
from cpuforge.tasks.engine.losses import distillation_loss
from cpuforge.tasks.engine.trainer import RunFacts, train
from cpuforge.tasks.engine.training_run import recover_train_config, threads_per_process
from cpuforge.tasks.engine.validation import evaluate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("summary", help="summary JSON of a cpuforge run that went through recover")
    parser.add_argument("--arms", nargs="+", required=True,
                        help="one arm per argument: space-separated recover.KEY=VALUE overrides ('' = as the run)")
    parser.add_argument("--steps", type=int, help="distillation steps per arm (default: the run's recover steps)")
    parser.add_argument("--precision", choices=("fp32", "bf16"),
                        help="default: what the run's recover stage trained in")
    parser.add_argument("--workdir", default="/tmp/cpuforge-recover-ab")
    parser.add_argument("--json", help="write the table here too")
    args = parser.parse_args()

    summary = json.loads(Path(args.summary).read_text())
    stages = summary["stages"]
    if "recover" not in stages:
        raise SystemExit(f"{args.summary} has no recover stage: give the summary of a run that went through it")
    steps = args.steps or stages["recover"]["metrics"]["steps"]
    recovered = json.loads((Path(stages["recover"]["output_dir"]) / "model" / "config.json").read_text())
    trained_in = recovered.get("cpuforge", {}).get("dtype", "float32")  # what the stage's trainer ran in
    precision = args.precision or ("bf16" if trained_in == "bfloat16" else "fp32")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    teacher_dir, student_dir = (Path(stages[s]["output_dir"]) / "model" for s in ("pretrain", "prune"))
    teacher = load_model(teacher_dir)
    shards = open_shards(Path(stages["tokenize"]["output_dir"]), teacher.cfg.block_size)
    lengths = token_byte_lengths(shards.tokenizer_path)
    run_config = Path(summary["run_dir"]) / "config.yaml"
    train_cfg = load_config(config_file=run_config).train  # the arms change recover.* only
    torch.set_num_threads(threads_per_process(train_cfg))
    val = val_batches(shards.val, train_cfg.eval_batches, train_cfg.batch_size, teacher.cfg.block_size)
    _, teacher_bpb = evaluate(teacher, val, lengths)
    print(f"teacher (unpruned) val bpb {teacher_bpb:.4f} (fp32); {steps} steps per arm in {precision}")

    table = []
    for arm in args.arms:
        r = load_config(config_file=run_config, overrides=[f"recover.{o}" for o in arm.split()]).recover
        s = recover_train_config(train_cfg, r).model_copy(update={
            "max_steps": steps, "max_tokens": None, "max_minutes": None, "eval_interval": 10**9,
            "checkpoint_every_steps": 10**9, "checkpoint_every_minutes": 10**9})
        torch.manual_seed(train_cfg.seed)
        student = load_model(student_dir)
        ckpt = Path(args.workdir) / (arm.replace(" ", "_") or "as-run")
        shutil.rmtree(ckpt, ignore_errors=True)  # a fresh run, not a resume of the last one
        started = time.perf_counter()
        train(student, shards.train, val, lengths, s, ckpt, RunFacts(dtype),
              loss_fn=distillation_loss(teacher, r.temperature, r.kd_weight, r.lm_weight))
        _, bpb = evaluate(student, val, lengths)  # fp32, like the teacher's figure
        gap = bpb / teacher_bpb - 1
        print(f"  {arm or '(as the run)':<36} val bpb {bpb:.4f}  {100 * gap:+6.2f}% vs teacher"
              f"  ({time.perf_counter() - started:.0f} s)", flush=True)
        table.append({"arm": arm, "lr": r.lr, "temperature": r.temperature, "kd_weight": r.kd_weight,
                      "lm_weight": r.lm_weight, "optimizer": s.optimizer_in_use(), "muon_lr": r.muon_lr, "steps": steps,
                      "seconds": round(time.perf_counter() - started, 1), "val_bpb": round(bpb, 4),
                      "vs_teacher": round(gap, 4)})
    if args.json:
        Path(args.json).write_text(json.dumps({"teacher_bpb": round(teacher_bpb, 4), "precision": precision,
                                               "rows": table}, indent=2))


if __name__ == "__main__":
    main()
