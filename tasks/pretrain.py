"""Stage 2, pretrain: token shards -> a Llama-style decoder trained on the CPU.

Output folder: ``model/`` (safetensors + config.json + tokenizer.json, loadable alone),
``checkpoints/`` (the last two training checkpoints, for resume and for continuing),
``history.jsonl``, ``loss_curve.png``, ``samples.txt``, ``result.json``.
With ``train.nproc_per_node * train.nnodes > 1`` the same training runs under torchrun
(DDP over gloo); rank 0 logs and checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State
from tokenizers import Tokenizer

from models.checkpoint import CheckpointError, load_model, save_model
from models.config import LlamaConfig, ModelConfigError
from models.fileio import atomic_write_json, atomic_write_text
from models.llama import Llama, generate, param_count
from tasks import tracking
from tasks.config import Config
from tasks.data import open_shards, token_byte_lengths, unigram_bpb, val_batches
from tasks.errors import ConfigError, UserError
from tasks.hardware import available_cores, choose_precision, matmul_peak
from tasks.progress import budget_bar
from tasks.publish import finish_stage
from tasks.stage import StageContext, StageOutput, StageSpec, run_stage
from tasks.store import StageRecord
from tasks.trainer import TrainSettings, train

log = logging.getLogger("cpuforge.pretrain")

SPEC = StageSpec(name="pretrain", version="1", sections=("model", "train"))
SAMPLE_SEED = 1234


def model_config(cfg: Config, vocab_size: int) -> LlamaConfig:
    try:
        return LlamaConfig(vocab_size=vocab_size, **cfg.model.model_dump())
    except ModelConfigError as exc:
        raise ConfigError(f"model: {exc}") from None


def threads_per_process(cfg: Config) -> int:
    return cfg.train.threads or max(1, available_cores() // cfg.train.nproc_per_node)


def settings(cfg: Config, dtype: torch.dtype, peak_flops: float) -> TrainSettings:
    t = cfg.train
    return TrainSettings(
        batch_size=t.batch_size, grad_accum=t.grad_accum, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay, betas=t.betas, grad_clip=t.grad_clip, max_tokens=t.max_tokens,
        max_steps=t.max_steps, max_minutes=t.max_minutes, eval_interval=t.eval_interval,
        checkpoint_every_steps=t.checkpoint_every_steps, checkpoint_every_minutes=t.checkpoint_every_minutes,
        seed=t.seed, dtype=dtype, peak_flops=peak_flops,
    )


def run_training(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the model and train it. Runs in this process, or in each torchrun worker."""
    import torch.distributed as dist

    cfg = Config.model_validate(spec["config"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(cfg.train.seed)
    shards = open_shards(Path(spec["tokenize_dir"]), cfg.model.block_size)
    model = Llama(model_config(cfg, shards.vocab_size))
    model.activation_checkpointing = cfg.train.activation_checkpointing
    if cfg.train.compile:
        model.forward = torch.compile(model.forward)  # type: ignore[method-assign]
    out_dir = Path(spec["out_dir"])
    byte_lengths = token_byte_lengths(shards.tokenizer_path)
    val = val_batches(shards.val, cfg.train.eval_batches, cfg.train.batch_size, cfg.model.block_size)
    dtype = getattr(torch, spec["dtype"])
    logger = tracking.MetricLogger(spec["tracking_uri"], spec["run_id"]) if rank == 0 and spec.get("run_id") else None

    with budget_bar("pretrain") if rank == 0 else _null_bar() as update:
        result = train(model, shards.train, val, byte_lengths, settings(cfg, dtype, spec["peak_flops"]),
                       out_dir / "checkpoints", log_metrics=logger, on_progress=update)
    if logger:
        logger.flush()
    if rank == 0:
        save_model(model, out_dir / "model", extra={"dtype": spec["dtype"]})
        shutil.copy(shards.tokenizer_path, out_dir / "model" / "tokenizer.json")
        atomic_write_text(out_dir / "history.jsonl", "".join(json.dumps(h) + "\n" for h in result.history))
        summary = {k: v for k, v in asdict(result).items() if k != "history"}
        atomic_write_json(out_dir / "result.json", summary)
        return summary
    return {}


class _null_bar:
    def __enter__(self):
        return lambda fraction, status: None

    def __exit__(self, *exc):
        return False


def launch_torchrun(cfg: Config, spec_path: Path, key: str) -> None:
    """Run tasks.distributed under torchrun; every process trains, rank 0 writes the outputs."""
    t = cfg.train
    rendezvous = ["--standalone"] if t.nnodes == 1 else [
        f"--nnodes={t.nnodes}", "--rdzv_backend=c10d", f"--rdzv_endpoint={t.rdzv_endpoint}", f"--rdzv_id={key[:16]}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc_per_node={t.nproc_per_node}",
           "-m", "tasks.distributed", str(spec_path)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_process(cfg))}
    log.info("launching: %s", " ".join(cmd))
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited with code {proc.returncode} (its workers' logs are above)")


def pretrain(cfg: Config, tokenized: StageRecord, out_dir: Path, run_id: str, ctx: StageContext) -> StageOutput:
    started = time.perf_counter()
    tok_dir = Path(tokenized.output_dir)
    shards = open_shards(tok_dir, cfg.model.block_size)  # fails early on missing/short shards
    model_cfg = model_config(cfg, shards.vocab_size)
    threads = threads_per_process(cfg)
    dtype = choose_precision(cfg.train.precision)
    peak = matmul_peak(threads, ctx.cache_dir)
    world = cfg.train.nproc_per_node * cfg.train.nnodes
    spec = {
        "config": cfg.model_dump(mode="json"), "tokenize_dir": str(tok_dir), "out_dir": str(out_dir),
        "threads": threads, "dtype": str(dtype).removeprefix("torch."), "peak_flops": peak,
        "tracking_uri": ctx.tracking_uri, "run_id": run_id,
    }
    _check_resumable(out_dir / "checkpoints", model_cfg)
    tracking.log_params(run_id, {"threads": threads, "precision": spec["dtype"], "world_size": world,
                                 "matmul_peak_gflops": round(peak / 1e9, 1)})
    if world > 1:
        spec_path = out_dir / "launch.json"
        atomic_write_json(spec_path, spec)
        launch_torchrun(cfg, spec_path, tokenized.key)
        result = json.loads((out_dir / "result.json").read_text())
    else:
        result = run_training(spec)

    model = load_model(out_dir / "model")
    samples = write_samples(model, Tokenizer.from_file(str(out_dir / "model" / "tokenizer.json")), cfg, shards.eod_id)
    atomic_write_text(out_dir / "samples.txt", samples)
    history = [json.loads(line) for line in (out_dir / "history.jsonl").read_text().splitlines()]
    plot_loss_curve(history, out_dir / "loss_curve.png")
    baseline = unigram_bpb(shards.train, shards.val, shards.vocab_size, token_byte_lengths(shards.tokenizer_path))
    metrics = {
        "params": param_count(model), "tokens": result["tokens"], "steps": result["steps"],
        "tokens_per_s": round(result["tokens_per_s"], 1), "mfu": round(result["mfu"], 4),
        "val_loss": round(result["val_loss"], 4), "val_bpb": round(result["val_bpb"], 4),
        "unigram_bpb": round(baseline, 4), "peak_rss_mb": round(result["peak_rss_mb"], 1),
        "seconds": round(time.perf_counter() - started, 2), "train_seconds": round(result["seconds"], 2),
        "matmul_peak_gflops": round(peak / 1e9, 1), "world_size": world, "threads": threads,
    }
    log.info("pretrained %s params on %s tokens: val bpb %.3f (unigram baseline %.3f)",
             f"{metrics['params']:,}", f"{metrics['tokens']:,}", metrics["val_bpb"], baseline)
    return StageOutput(
        metrics=metrics,
        files={"model": "model", "tokenizer": "model/tokenizer.json", "checkpoints": "checkpoints",
               "loss_curve": "loss_curve.png", "samples": "samples.txt", "history": "history.jsonl"},
        artifacts=["model", "loss_curve.png", "samples.txt"],
        info={"model_config": model_cfg.to_dict(), "resumed_from_step": result.get("resumed_from")},
    )


def _check_resumable(checkpoints: Path, expected: LlamaConfig) -> None:
    """A leftover checkpoint for another model in this folder would be a bug; say so before training."""
    from models.checkpoint import latest_valid_checkpoint, read_config

    found = latest_valid_checkpoint(checkpoints)
    if found is not None:
        try:
            if read_config(found) != expected:
                raise UserError(f"{found} holds a checkpoint of another model config; delete {checkpoints} to start over")
        except CheckpointError as exc:
            raise UserError(str(exc)) from None


def write_samples(model: Llama, tokenizer: Tokenizer, cfg: Config, eod_id: int) -> str:
    generator = torch.Generator().manual_seed(SAMPLE_SEED)
    tokenizer.encode_special_tokens = True
    parts = []
    for prompt in cfg.eval.prompts:
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids[: model.cfg.block_size - 1] or [eod_id]
        out = generate(model, ids, cfg.eval.max_new_tokens, temperature=0.8, top_k=40, stop_token=eod_id,
                       generator=generator)
        parts.append(f"=== prompt: {prompt!r}\n{prompt}{tokenizer.decode(out)}\n")
    return "\n".join(parts)


def plot_loss_curve(history: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="train loss", lw=1)
    evals = [h for h in history if "val_loss" in h]
    ax.plot([h["step"] for h in evals], [h["val_loss"] for h in evals], "o-", label="val loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@task(name="pretrain", cache_policy=NO_CACHE, tags=["cpuforge-training"])
def pretrain_task(ctx: StageContext, tokenize: StageRecord) -> State:
    record = run_stage(SPEC, ctx, lambda out_dir, run_id: pretrain(ctx.cfg, tokenize, out_dir, run_id, ctx),
                       inputs={"tokenize": tokenize})
    return finish_stage(record, ctx)
