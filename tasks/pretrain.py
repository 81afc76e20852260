"""Stage 2, pretrain: token shards -> a Llama-style decoder trained on the CPU.

Output folder: ``model/`` (safetensors + config.json + tokenizer.json, loadable alone),
``checkpoints/`` (the last two training checkpoints, for resume and for continuing),
``history.jsonl``, ``loss_curve.png``, ``samples.txt``, ``result.json``.
With ``train.nproc_per_node * train.nnodes > 1`` the same training runs under torchrun
(DDP over gloo); rank 0 logs and checkpoints (see tasks/engine/training_run.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from cpuforge.models.checkpoint import CheckpointError, latest_valid_checkpoint, read_config
from cpuforge.models.config import LlamaConfig
from cpuforge.models.llama import config_param_count
from cpuforge.tasks import stages
from cpuforge.tasks.config import Config
from cpuforge.tasks.engine.data import open_shards, token_byte_lengths, unigram_bpb
from cpuforge.tasks.engine.training_run import (
    execute,
    model_config,
    precision_metrics,
    precision_params,
    training_spec,
    world_size,
)
from cpuforge.tasks.errors import UserError
from cpuforge.tasks.infra import tracking
from cpuforge.tasks.infra.publish import finish_stage
from cpuforge.tasks.infra.stage import TRAINING_RETRIES, TRAINING_TAG, StageContext, StageOutput, run_stage
from cpuforge.tasks.infra.store import StageRecord
from cpuforge.tasks.lineage import PretrainedSource
from cpuforge.tasks.model_card import write_model_card
from cpuforge.tasks.reports import training_reports

log = logging.getLogger("cpuforge.pretrain")

SPEC = stages.PRETRAIN


def pretrain(cfg: Config, tokenized: StageRecord, out_dir: Path, run_id: str, ctx: StageContext,
             init: PretrainedSource | None = None) -> StageOutput:
    started = time.perf_counter()
    tok_dir = Path(tokenized.output_dir)
    shards = open_shards(tok_dir, cfg.model.block_size)  # fails early on missing/short shards
    model_cfg = model_config(cfg, shards.vocab_size)
    world = world_size(cfg)
    spec = training_spec("pretrain", cfg, tok_dir, out_dir, run_id, ctx,
                         **({"init_dir": Path(init.folder)} if init else {}))
    threads, peak = spec["threads"], spec["peak_flops"]
    _check_resumable(out_dir / "checkpoints", model_cfg)
    tracking.log_params(run_id, {"threads": threads, "world_size": world, **precision_params(spec),
                                 "init": init.origin if init else "scratch"})
    result = execute(spec, cfg)
    training_reports(out_dir, cfg, shards.eod_id)
    baseline = unigram_bpb(shards.train, shards.val, shards.vocab_size, token_byte_lengths(shards.tokenizer_path))
    metrics = {
        "params": config_param_count(model_cfg), "tokens": result["tokens"], "steps": result["steps"],
        "tokens_per_s": round(result["tokens_per_s"], 1), "mfu": round(result["mfu"], 4),
        "val_loss": round(result["val_loss"], 4), "val_bpb": round(result["val_bpb"], 4),
        "unigram_bpb": round(baseline, 4), "peak_rss_mb": round(result["peak_rss_mb"], 1),
        "seconds": round(time.perf_counter() - started, 2), "train_seconds": round(result["seconds"], 2),
        "matmul_peak_gflops": round(peak / 1e9, 1), "world_size": world, "threads": threads,
        "flops_per_token": spec["flops_per_token"], **precision_metrics(spec),
    }
    write_model_card(out_dir / "model", cfg, ("tokenize", "pretrain"), tokenized, metrics, init.origin if init else "")
    log.info("pretrained %s params on %s tokens: val bpb %.3f (unigram baseline %.3f)",
             f"{metrics['params']:,}", f"{metrics['tokens']:,}", metrics["val_bpb"], baseline)
    return StageOutput(
        metrics=metrics,
        files={"model": "model", "tokenizer": "model/tokenizer.json", "checkpoints": "checkpoints",
               "loss_curve": "loss_curve.png", "samples": "samples.txt", "history": "history.jsonl"},
        artifacts=["model", "loss_curve.png", "samples.txt"],
        info={"model_config": model_cfg.to_dict(), "resumed_from_step": result.get("resumed_from"),
              "init": init.as_dict() if init else None},
    )


def _check_resumable(checkpoints: Path, expected: LlamaConfig) -> None:
    """A leftover checkpoint for another model in this folder would be a bug; say so before training."""
    found = latest_valid_checkpoint(checkpoints)
    if found is not None:
        try:
            if read_config(found) != expected:
                raise UserError(f"{found} holds a checkpoint of another model config; delete {checkpoints} to start over")
        except CheckpointError as exc:
            raise UserError(str(exc)) from None


@task(name="pretrain", cache_policy=NO_CACHE, tags=[TRAINING_TAG], **TRAINING_RETRIES)
def pretrain_task(ctx: StageContext, tokenize: StageRecord, init: PretrainedSource | None = None) -> State:
    """A retry (or a rerun after a crash) resumes from the stage's last checkpoint."""
    record = run_stage(SPEC, ctx, lambda out_dir, run_id: pretrain(ctx.cfg, tokenize, out_dir, run_id, ctx, init),
                       inputs={"tokenize": tokenize}, extra_key=init.sha256 if init else None)
    return finish_stage(record, ctx)
