"""Stage 4, recover: distil the unpruned model (teacher) into the pruned one (student).

Loss = kd_weight * T^2 * KL(teacher || student) on logits softened by temperature T
     + lm_weight * next-token cross-entropy,
trained by the same engine as pretraining (budgets, checkpoints, exact resume), by default for
a small fraction of the pretraining budget.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from models.checkpoint import load_model, save_model
from models.fileio import atomic_write_text
from models.llama import Llama, param_count
from tasks import tracking
from tasks.config import Config
from tasks.data import open_shards, token_byte_lengths, val_batches
from tasks.errors import UserError
from tasks.hardware import choose_precision, matmul_peak
from tasks.pretrain import plot_loss_curve, settings, threads_per_process
from tasks.progress import budget_bar
from tasks.publish import finish_stage
from tasks.stage import StageContext, StageOutput, StageSpec, run_stage
from tasks.store import StageRecord
from tasks.trainer import train

log = logging.getLogger("cpuforge.recover")

SPEC = StageSpec(name="recover", version="1", sections=("recover", "train"))


def distillation_loss(teacher: Llama, temperature: float, kd_weight: float, lm_weight: float):
    teacher.eval()

    def loss(student: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
        logits, _ = student(x)
        with torch.no_grad():
            teacher_logits, _ = teacher(x)
        vocab = logits.size(-1)
        lm = F.cross_entropy(logits.view(-1, vocab), y.reshape(-1))
        kd = F.kl_div(F.log_softmax(logits.view(-1, vocab) / temperature, dim=-1),
                      F.log_softmax(teacher_logits.view(-1, vocab) / temperature, dim=-1),
                      log_target=True, reduction="batchmean") * temperature**2
        return kd_weight * kd + lm_weight * lm, {"kd_loss": kd.item(), "lm_loss": lm.item()}

    return loss


def recover(cfg: Config, tokenized: StageRecord, pretrained: StageRecord, pruned: StageRecord,
            out_dir: Path, run_id: str, ctx: StageContext) -> StageOutput:
    started = time.perf_counter()
    teacher = load_model(pretrained.path("model"))
    student = load_model(pruned.path("model"))
    if teacher.cfg.vocab_size != student.cfg.vocab_size:
        raise UserError(f"teacher and student vocabularies differ ({teacher.cfg.vocab_size} vs "
                        f"{student.cfg.vocab_size}): distillation compares their logits token by token")
    if cfg.train.nproc_per_node * cfg.train.nnodes > 1:
        log.warning("recover runs in one process; train.nproc_per_node/nnodes apply to pretraining only")
    threads = threads_per_process(cfg)
    torch.set_num_threads(threads)
    shards = open_shards(Path(tokenized.output_dir), student.cfg.block_size)
    lengths = token_byte_lengths(shards.tokenizer_path)
    val = val_batches(shards.val, cfg.train.eval_batches, cfg.train.batch_size, student.cfg.block_size)
    r = cfg.recover
    s = replace(settings(cfg, choose_precision(cfg.train.precision), matmul_peak(threads, ctx.cache_dir)),
                lr=r.lr, min_lr=r.lr / 10, warmup_steps=min(cfg.train.warmup_steps, 10),
                max_tokens=r.max_tokens, max_steps=r.max_steps, max_minutes=r.max_minutes,
                seed=cfg.train.seed + 1)  # a data stream of its own, not a replay of pretraining's first steps
    logger = tracking.MetricLogger(ctx.tracking_uri, run_id)
    with budget_bar("recover") as update:
        result = train(student, shards.train, val, lengths, s, out_dir / "checkpoints",
                       loss_fn=distillation_loss(teacher, r.temperature, r.kd_weight, r.lm_weight),
                       log_metrics=logger, on_progress=update)
    logger.flush()
    save_model(student, out_dir / "model")
    shutil.copy(pruned.path("tokenizer"), out_dir / "model" / "tokenizer.json")
    atomic_write_text(out_dir / "history.jsonl", "".join(json.dumps(h) + "\n" for h in result.history))
    plot_loss_curve(result.history, out_dir / "loss_curve.png")
    pretrain_tokens = pretrained.metrics.get("tokens", 0)
    log.info("recovered on %s tokens (%.0f%% of pretraining): val bpb %.3f (right after pruning %.3f)",
             f"{result.tokens:,}", 100 * result.tokens / max(1, pretrain_tokens), result.val_bpb,
             pruned.metrics.get("val_bpb_after", float("nan")))
    return StageOutput(
        metrics={"tokens": result.tokens, "steps": result.steps, "val_loss": round(result.val_loss, 4),
                 "val_bpb": round(result.val_bpb, 4), "params": param_count(student),
                 "tokens_vs_pretrain": round(result.tokens / max(1, pretrain_tokens), 4),
                 "tokens_per_s": round(result.tokens_per_s, 1), "peak_rss_mb": round(result.peak_rss_mb, 1),
                 "seconds": round(time.perf_counter() - started, 2)},
        files={"model": "model", "tokenizer": "model/tokenizer.json", "checkpoints": "checkpoints",
               "loss_curve": "loss_curve.png", "history": "history.jsonl"},
        artifacts=["model", "loss_curve.png"],
        info={"resumed_from_step": result.resumed_from},
    )


@task(name="recover", cache_policy=NO_CACHE, tags=["cpuforge-training"])
def recover_task(ctx: StageContext, tokenize: StageRecord, pretrain: StageRecord, prune: StageRecord) -> State:
    record = run_stage(
        SPEC, ctx, lambda out_dir, run_id: recover(ctx.cfg, tokenize, pretrain, prune, out_dir, run_id, ctx),
        inputs={"tokenize": tokenize, "pretrain": pretrain, "prune": prune})
    return finish_stage(record, ctx)
