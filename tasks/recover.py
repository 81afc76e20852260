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

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from cpuforge.models.checkpoint import read_config
from cpuforge.models.llama import config_param_count, flops_per_token
from cpuforge.tasks import stages
from cpuforge.tasks.config import Config
from cpuforge.tasks.engine.data import open_shards
from cpuforge.tasks.engine.training_run import execute, precision_metrics, precision_params, training_spec, world_size
from cpuforge.tasks.errors import UserError
from cpuforge.tasks.infra import tracking
from cpuforge.tasks.infra.publish import finish_stage
from cpuforge.tasks.infra.stage import TRAINING_RETRIES, TRAINING_TAG, StageContext, StageOutput, run_stage
from cpuforge.tasks.infra.store import StageRecord
from cpuforge.tasks.model_card import write_model_card
from cpuforge.tasks.reports import training_reports

log = logging.getLogger("cpuforge.recover")

SPEC = stages.RECOVER


def recover(cfg: Config, tokenized: StageRecord, pretrained: StageRecord, pruned: StageRecord,
            out_dir: Path, run_id: str, ctx: StageContext) -> StageOutput:
    started = time.perf_counter()
    teacher_cfg, student_cfg = read_config(pretrained.path("model")), read_config(pruned.path("model"))
    if teacher_cfg.vocab_size != student_cfg.vocab_size:
        raise UserError(f"teacher and student vocabularies differ ({teacher_cfg.vocab_size} vs "
                        f"{student_cfg.vocab_size}): distillation compares their logits token by token")
    shards = open_shards(Path(tokenized.output_dir), student_cfg.block_size)
    spec = training_spec("recover", cfg, tokenized.output_dir, out_dir, run_id, ctx,
                         student_dir=pruned.path("model"), teacher_dir=pretrained.path("model"))
    tracking.log_params(run_id, {"threads": spec["threads"], "world_size": world_size(cfg), **precision_params(spec)})
    result = execute(spec, cfg)
    training_reports(out_dir, cfg, shards.eod_id)
    pretrain_tokens = pretrained.metrics.get("tokens", 0)
    metrics = {"tokens": result["tokens"], "steps": result["steps"], "val_loss": round(result["val_loss"], 4),
               "val_bpb": round(result["val_bpb"], 4), "params": config_param_count(student_cfg),
               "tokens_vs_pretrain": round(result["tokens"] / max(1, pretrain_tokens), 4),
               "tokens_per_s": round(result["tokens_per_s"], 1), "peak_rss_mb": round(result["peak_rss_mb"], 1),
               "seconds": round(time.perf_counter() - started, 2), "world_size": world_size(cfg),
               # MFU counts the teacher's forward passes too: the step computes them
               "mfu": round(result["mfu"], 4), "flops_per_token": spec["flops_per_token"],
               "teacher_forward_flops_per_token": flops_per_token(teacher_cfg, backward=False),
               "matmul_peak_gflops": round(spec["peak_flops"] / 1e9, 1), **precision_metrics(spec)}
    write_model_card(out_dir / "model", cfg, (pretrained.stage, "prune", "recover"), tokenized, metrics)
    log.info("recovered on %s tokens (%.0f%% of pretraining): val bpb %.3f (right after pruning %.3f)",
             f"{result['tokens']:,}", 100 * result["tokens"] / max(1, pretrain_tokens), result["val_bpb"],
             pruned.metrics.get("val_bpb_after", float("nan")))
    return StageOutput(
        metrics=metrics,
        files={"model": "model", "tokenizer": "model/tokenizer.json", "checkpoints": "checkpoints",
               "loss_curve": "loss_curve.png", "history": "history.jsonl", "samples": "samples.txt"},
        artifacts=["model", "loss_curve.png", "samples.txt"],
        info={"resumed_from_step": result.get("resumed_from")},
    )


@task(name="recover", cache_policy=NO_CACHE, tags=[TRAINING_TAG], **TRAINING_RETRIES)
def recover_task(ctx: StageContext, tokenize: StageRecord, pretrain: StageRecord, prune: StageRecord) -> State:
    """A retry (or a rerun after a crash) resumes from the stage's last checkpoint."""
    record = run_stage(
        SPEC, ctx, lambda out_dir, run_id: recover(ctx.cfg, tokenize, pretrain, prune, out_dir, run_id, ctx),
        inputs={"tokenize": tokenize, "pretrain": pretrain, "prune": prune})
    return finish_stage(record, ctx)
