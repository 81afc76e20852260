"""Stage 4, recover: distil the unpruned model (teacher) into the pruned one (student).

Loss = kd_weight * T^2 * KL(teacher || student) on logits softened by temperature T
     + lm_weight * next-token cross-entropy,
trained by the same engine as pretraining (budgets, checkpoints, exact resume, torchrun), by
default for a small fraction of the pretraining budget.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from cpuforge.models.checkpoint import read_config
from cpuforge.models.llama import config_param_count, flops_per_token
from cpuforge.tasks import stages
from cpuforge.tasks.config.settings import RecoverConfig, TrainConfig
from cpuforge.tasks.engine.data import open_shards
from cpuforge.tasks.engine.training_run import (
    TrainingHooks,
    compile_metrics,
    compile_params,
    execute,
    precision_metrics,
    precision_params,
    training_spec,
    world_size,
)
from cpuforge.tasks.infra import live, tracking
from cpuforge.tasks.infra.locks import training_slot
from cpuforge.tasks.infra.stage import StageOutput, StageRun, key_config
from cpuforge.tasks.records.errors import UserError
from cpuforge.tasks.release.model_card import made_by, write_model_card
from cpuforge.tasks.release.reports import training_reports

log = logging.getLogger("cpuforge.recover")

SPEC = stages.RECOVER
HOOKS = TrainingHooks.of(metrics=tracking.MetricLogger, slot=training_slot)  # as pretraining's (pretrain.HOOKS)


def work(run: StageRun, recover: RecoverConfig, train: TrainConfig) -> StageOutput:
    started = time.perf_counter()
    tokenized, pretrained, pruned = run.inputs["tokenize"], run.inputs["pretrain"], run.inputs["prune"]
    teacher_cfg, student_cfg = read_config(pretrained.path("model")), read_config(pruned.path("model"))
    if teacher_cfg.vocab_size != student_cfg.vocab_size:
        raise UserError(f"teacher and student vocabularies differ ({teacher_cfg.vocab_size} vs "
                        f"{student_cfg.vocab_size}): distillation compares their logits token by token")
    open_shards(Path(tokenized.output_dir), student_cfg.block_size)  # fails early on missing/short shards
    spec = training_spec("recover", train, tokenized.output_dir, run.out_dir, run.run_id, run.cache_dir,
                         run.tracking_uri, recover=recover, student_dir=pruned.path("model"),
                         teacher_dir=pretrained.path("model"), hooks=HOOKS)
    world = world_size(train)
    tracking.log_params(run.run_id, {"threads": spec.threads, "world_size": world, **precision_params(spec)})
    result = execute(spec, None if run.report is live.nothing else run.report)  # Prefect's live progress
    tracking.log_params(run.run_id, compile_params(result.compile))
    training_reports(run.out_dir)
    metrics = {"tokens": result.tokens, "steps": result.steps, "val_loss": round(result.val_loss, 4),
               "val_bpb": round(result.val_bpb, 4), "params": config_param_count(student_cfg),
               **against_teacher(result.tokens, result.val_bpb, pretrained.metrics),
               "tokens_per_s": round(result.tokens_per_s, 1), "peak_rss_mb": round(result.peak_rss_mb, 1),
               "seconds": round(time.perf_counter() - started, 2), "world_size": world,
               # MFU counts the teacher's forward passes too: the step computes them
               "mfu": round(result.mfu, 4), "flops_per_token": spec.flops_per_token,
               "teacher_forward_flops_per_token": flops_per_token(teacher_cfg, backward=False),
               "matmul_peak_gflops": round(spec.peak_flops / 1e9, 1), **precision_metrics(spec),
               **compile_metrics(result.compile)}
    write_model_card(run.out_dir / "model", [*made_by(tokenized, pretrained, pruned),
                     (SPEC.name, {"recover": key_config("recover", recover), "train": key_config("train", train)})],
                     tokenized, metrics)
    log.info("recovered on %s tokens%s: val bpb %.3f, %s (right after pruning %.3f)", f"{result.tokens:,}",
             f" ({100 * metrics['tokens_vs_pretrain']:.1f}% of pretraining)" if "tokens_vs_pretrain" in metrics else "",
             result.val_bpb, f"teacher {metrics['teacher_val_bpb']:.3f} ({100 * metrics['bpb_vs_teacher']:+.1f}%)"
             if "bpb_vs_teacher" in metrics else "teacher not scored", pruned.metrics.get("val_bpb_after", float("nan")))
    return StageOutput(
        metrics=metrics,
        files={"model": "model", "tokenizer": "model/tokenizer.json", "checkpoints": "checkpoints",
               "loss_curve": "loss_curve.png", "history": "history.jsonl"},
        artifacts=["model", "loss_curve.png"],
        info={"resumed_from_step": result.resumed_from},
    )


def against_teacher(tokens: int, val_bpb: float, teacher: dict) -> dict:
    """Recovery measured against its teacher: the teacher's val bits per byte and the gap to it, and the tokens
    as a share of pretraining's only where the teacher was pretrained here (an adopted model has no such figure)."""
    figures: dict = {}
    if teacher.get("val_bpb"):
        figures["teacher_val_bpb"] = teacher["val_bpb"]
        figures["bpb_vs_teacher"] = round(val_bpb / teacher["val_bpb"] - 1, 4)
    if teacher.get("tokens"):
        figures["tokens_vs_pretrain"] = round(tokens / teacher["tokens"], 4)
    return figures
