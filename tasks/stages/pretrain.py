"""Stage 2, pretrain: token shards -> a Llama-style decoder trained on the CPU.

Output folder: ``model/`` (safetensors + config.json + tokenizer.json, loadable alone),
``checkpoints/`` (the last two training checkpoints, for resume and for continuing),
``history.jsonl``, ``loss_curve.png``, ``result.json`` (samples of every model: evaluate's).
With ``train.nproc_per_node * train.nnodes > 1`` the same training runs under torchrun
(DDP over gloo); rank 0 logs and checkpoints (see tasks/engine/training_run.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from cpuforge.models.checkpoint import CheckpointError, latest_valid_checkpoint, read_config
from cpuforge.models.config import LlamaConfig
from cpuforge.models.llama import config_param_count
from cpuforge.tasks import stages
from cpuforge.tasks.config.settings import AUTO, ModelConfig, TrainConfig
from cpuforge.tasks.engine.data import open_shards, token_byte_lengths, unigram_bpb
from cpuforge.tasks.engine.sizing import explain_shape
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

log = logging.getLogger("cpuforge.pretrain")

SPEC = stages.PRETRAIN
# What the pipeline plugs into the engine: per-step metrics to the stage's MLflow run, from rank 0 in
# whichever process it trains, and one of the machine's training slots, here and on machines that join.
HOOKS = TrainingHooks.of(metrics=tracking.MetricLogger, slot=training_slot)


def work(run: StageRun, model: ModelConfig, train: TrainConfig) -> StageOutput:
    started = time.perf_counter()
    tokenized, init = run.inputs["tokenize"], run.source
    tok_dir = Path(tokenized.output_dir)
    shards = open_shards(tok_dir, model.block_size)  # fails early on missing/short shards
    model_cfg = model.shape(shards.vocab_size)
    world = world_size(train)
    spec = training_spec("pretrain", train, tok_dir, run.out_dir, run.run_id, run.cache_dir, run.tracking_uri,
                         model=model_cfg, hooks=HOOKS, **({"init_dir": Path(init.folder)} if init else {}))
    _check_resumable(run.out_dir / "checkpoints", model_cfg)
    sized = explain_shape(model_cfg, train, run.cache_dir) if model.size == AUTO and not init else None
    if sized is not None:
        log.info("model.size=auto: %s", sized.reason)
    tracking.log_params(run.run_id, {"threads": spec.threads, "world_size": world, **precision_params(spec),
                                     "init": init.origin if init else "scratch", **(sized.as_params() if sized else {})})
    result = execute(spec, None if run.report is live.nothing else run.report)  # Prefect's live progress
    tracking.log_params(run.run_id, compile_params(result.compile))
    training_reports(run.out_dir)
    baseline = unigram_bpb(shards.train, shards.val, shards.vocab_size, token_byte_lengths(shards.tokenizer_path))
    metrics = {
        "params": config_param_count(model_cfg), "tokens": result.tokens, "steps": result.steps,
        "tokens_per_s": round(result.tokens_per_s, 1), "mfu": round(result.mfu, 4),
        "val_loss": round(result.val_loss, 4), "val_bpb": round(result.val_bpb, 4),
        "unigram_bpb": round(baseline, 4), "peak_rss_mb": round(result.peak_rss_mb, 1),
        "seconds": round(time.perf_counter() - started, 2), "train_seconds": round(result.seconds, 2),
        "matmul_peak_gflops": round(spec.peak_flops / 1e9, 1), "world_size": world, "threads": spec.threads,
        "flops_per_token": spec.flops_per_token, **precision_metrics(spec), **compile_metrics(result.compile),
        **(sized.as_metrics() if sized else {}),
    }
    write_model_card(run.out_dir / "model",
                     [*made_by(tokenized), (SPEC.name, {"model": key_config("model", model), "train": key_config("train", train)})],
                     tokenized, metrics, init.origin if init else "")
    log.info("pretrained %s params on %s tokens: val bpb %.3f (unigram baseline %.3f)",
             f"{metrics['params']:,}", f"{metrics['tokens']:,}", metrics["val_bpb"], baseline)
    return StageOutput(
        metrics=metrics,
        files={"model": "model", "tokenizer": "model/tokenizer.json", "checkpoints": "checkpoints",
               "loss_curve": "loss_curve.png", "history": "history.jsonl"},
        artifacts=["model", "loss_curve.png"],
        info={"model_config": model_cfg.to_dict(), "resumed_from_step": result.resumed_from,
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
