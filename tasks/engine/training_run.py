"""Running the training engine for a stage, in this process or under torchrun (DDP over gloo).

A stage writes a JSON spec (paths, config, MLflow run) and calls ``execute``. With
``train.nproc_per_node * train.nnodes > 1`` that launches ``cpuforge.tasks.engine.distributed`` under torchrun,
and every process calls ``run_training(spec)``; otherwise this process does. ``spec["kind"]``
says what is trained: ``pretrain`` (a fresh model, LM loss) or ``recover`` (the pruned
student distilled from the teacher). Rank 0 logs, checkpoints and writes the outputs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from cpuforge.models.checkpoint import load_model, read_config, save_model
from cpuforge.models.config import LlamaConfig, ModelConfigError
from cpuforge.models.fileio import atomic_write_json, atomic_write_text
from cpuforge.models.llama import Llama, flops_per_token
from cpuforge.tasks.config import Config
from cpuforge.tasks.engine import sharding
from cpuforge.tasks.engine.data import open_shards, token_byte_lengths, val_batches
from cpuforge.tasks.engine.hardware import available_cores, choose_precision, matmul_peak
from cpuforge.tasks.engine.progress import ProgressFile, budget_bar
from cpuforge.tasks.engine.rendezvous import torchrun_command
from cpuforge.tasks.engine.trainer import TrainSettings, distillation_loss, lm_loss, train
from cpuforge.tasks.errors import ConfigError
from cpuforge.tasks.infra import live, tracking
from cpuforge.tasks.infra.locks import training_slot
from cpuforge.tasks.infra.stage import StageContext

log = logging.getLogger("cpuforge.training")

PROGRESS_FILE = "progress.json"  # rank 0's latest progress, which the stage's process shows in Prefect


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
        seed=t.seed, dtype=dtype, peak_flops=peak_flops, strategy=t.strategy,
    )


def recover_settings(cfg: Config, dtype: torch.dtype, peak_flops: float) -> TrainSettings:
    """Pretraining's engine settings with recovery's budget and learning rate."""
    r = cfg.recover
    return replace(settings(cfg, dtype, peak_flops), lr=r.lr, min_lr=r.lr / 10,
                   warmup_steps=min(cfg.train.warmup_steps, 10), max_tokens=r.max_tokens, max_steps=r.max_steps,
                   max_minutes=r.max_minutes,
                   seed=cfg.train.seed + 1)  # a data stream of its own, not a replay of pretraining's first steps


def world_size(cfg: Config) -> int:
    return cfg.train.nproc_per_node * cfg.train.nnodes


def trained_shapes(kind: str, cfg: Config, tokenize_dir: Path | str,
                   **model_dirs: Path) -> tuple[LlamaConfig, LlamaConfig | None]:
    """(model trained, teacher or None) for a spec's kind, read from the configs on disk."""
    if kind == "recover":
        return read_config(Path(model_dirs["student_dir"])), read_config(Path(model_dirs["teacher_dir"]))
    vocab = open_shards(Path(tokenize_dir), cfg.model.block_size).vocab_size
    return model_config(cfg, vocab), None


def training_flops_per_token(model_cfg: LlamaConfig, teacher_cfg: LlamaConfig | None = None) -> float:
    """FLOPs a training step spends per token: the model's forward and backward, plus the teacher's
    forward pass when distilling (MFU counts all the work the step does)."""
    flops = flops_per_token(model_cfg)
    return flops + flops_per_token(teacher_cfg, backward=False) if teacher_cfg is not None else flops


def training_spec(kind: str, cfg: Config, tokenize_dir: Path | str, out_dir: Path, run_id: str,
                  ctx: StageContext, **model_dirs: Path) -> dict[str, Any]:
    """What run_training needs, as JSON (it may cross into torchrun workers). The precision is
    decided here, once (measured A/B under precision=auto), and MFU's denominator is the matmul
    peak of that precision."""
    threads = threads_per_process(cfg)
    model_cfg, teacher_cfg = trained_shapes(kind, cfg, tokenize_dir, **model_dirs)
    precision = choose_precision(cfg.train.precision, model_cfg, cfg.train.batch_size, threads, ctx.cache_dir,
                                 teacher_cfg)
    dtype = precision["dtype"]
    return {
        "kind": kind, "config": cfg.model_dump(mode="json"), "tokenize_dir": str(tokenize_dir),
        "out_dir": str(out_dir), "threads": threads, "dtype": dtype, "precision": precision,
        "peak_flops": matmul_peak(threads, ctx.cache_dir, getattr(torch, dtype)),
        "flops_per_token": training_flops_per_token(model_cfg, teacher_cfg),
        "tracking_uri": ctx.tracking_uri, "run_id": run_id,
        **{name: str(path) for name, path in model_dirs.items()},
    }


def precision_params(spec: dict[str, Any]) -> dict[str, Any]:
    """What a training stage logs to MLflow about its precision: the choice, why, and its peak."""
    p = spec.get("precision") or {}
    return {"precision": spec["dtype"], "precision_choice": p.get("reason", ""),
            "matmul_peak_gflops": round(spec["peak_flops"] / 1e9, 1), "matmul_peak_dtype": spec["dtype"]}


def precision_metrics(spec: dict[str, Any]) -> dict[str, float]:
    """The A/B's figures (tokens/s of a training step per precision), where they were measured."""
    p = spec.get("precision") or {}
    return {f"precision_{name}_tok_s": p[f"{name}_tok_s"] for name in ("fp32", "bf16")
            if p.get(f"{name}_tok_s") is not None}


def execute(spec: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """Train as the spec says, here or under torchrun; returns rank 0's result summary. Holds one of
    this machine's training slots meanwhile, waiting for one if they are all taken."""
    out_dir = Path(spec["out_dir"])
    progress = out_dir / PROGRESS_FILE
    progress.unlink(missing_ok=True)  # an interrupted attempt's: this one reports afresh
    with training_slot(f"{spec['kind']} {out_dir.name}"), live.live_stage(spec["kind"]) as report, \
            live.watch_progress_file(progress, report):
        if world_size(cfg) > 1:
            # The stage's folder (stage name and key) names the rendezvous: the same on every machine,
            # and another stage or config never joins it by mistake.
            spec = {**spec, "rdzv_id": out_dir.name.removesuffix(".partial")}
            spec_path = out_dir / "launch.json"
            atomic_write_json(spec_path, spec)
            launch_torchrun(cfg, spec_path, spec["rdzv_id"])
            return json.loads((out_dir / "result.json").read_text())
        return run_training(spec)


def _build(spec: dict[str, Any], cfg: Config, vocab_size: int):
    """(model to train, loss function, settings) for the spec's kind."""
    dtype = getattr(torch, spec["dtype"])
    if spec["kind"] == "recover":
        student, teacher = load_model(Path(spec["student_dir"])), load_model(Path(spec["teacher_dir"]))
        r = cfg.recover
        return student, distillation_loss(teacher, r.temperature, r.kd_weight, r.lm_weight), \
            replace(recover_settings(cfg, dtype, spec["peak_flops"]),
                    flops_per_token=training_flops_per_token(student.cfg, teacher.cfg))
    expected = model_config(cfg, vocab_size)
    # Continued pretraining starts from given weights (a checkpoint found later still takes precedence).
    model = load_model(Path(spec["init_dir"]), expect=expected) if spec.get("init_dir") else Llama(expected)
    return model, lm_loss, settings(cfg, dtype, spec["peak_flops"])


def run_training(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the model and train it. Runs in this process, or in each torchrun worker."""
    import torch.distributed as dist

    cfg = Config.model_validate(spec["config"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(cfg.train.seed)
    shards = open_shards(Path(spec["tokenize_dir"]), cfg.model.block_size)
    model, loss_fn, train_settings = _build(spec, cfg, shards.vocab_size)
    block = model.cfg.block_size
    model.activation_checkpointing = cfg.train.activation_checkpointing
    if cfg.train.compile:
        model.forward = torch.compile(model.forward)  # type: ignore[method-assign]
    out_dir = Path(spec["out_dir"])
    byte_lengths = token_byte_lengths(shards.tokenizer_path)
    val = val_batches(shards.val, cfg.train.eval_batches, cfg.train.batch_size, block)
    logger = tracking.MetricLogger(spec["tracking_uri"], spec["run_id"]) if rank == 0 and spec.get("run_id") else None

    quiet = contextlib.nullcontext(lambda fraction, status: None)  # only rank 0 draws progress
    live = ProgressFile(out_dir / PROGRESS_FILE) if rank == 0 else None

    def log_metrics(metrics: dict[str, float], step: int) -> None:
        if logger:
            logger(metrics, step)
        live.metrics(metrics, step)

    with budget_bar(spec["kind"]) if rank == 0 else quiet as update:
        def on_progress(fraction: float, status: str) -> None:
            update(fraction, status)
            live.progress(fraction, status, final=fraction >= 1.0)

        result = train(model, shards.train, val, byte_lengths, train_settings, out_dir / "checkpoints",
                       loss_fn=loss_fn, log_metrics=log_metrics if live else None,
                       on_progress=on_progress if live else update)
    if logger:
        logger.flush()
    weights = sharding.full_weights(model)  # every rank takes part when the model is sharded
    if rank == 0:
        save_model(model, out_dir / "model", extra={"dtype": spec["dtype"]}, weights=weights)
        shutil.copy(shards.tokenizer_path, out_dir / "model" / "tokenizer.json")
        atomic_write_text(out_dir / "history.jsonl", "".join(json.dumps(h) + "\n" for h in result.history))
        summary = {k: v for k, v in asdict(result).items() if k != "history"}
        atomic_write_json(out_dir / "result.json", summary)
        return summary
    return {}


def launch_torchrun(cfg: Config, spec_path: Path, rdzv_id: str) -> None:
    """Run cpuforge.tasks.engine.distributed under torchrun; every process trains, rank 0 writes the outputs."""
    cmd, network = torchrun_command(cfg, spec_path, rdzv_id)
    env = {**network, **os.environ, "OMP_NUM_THREADS": str(threads_per_process(cfg))}  # a GLOO_SOCKET_IFNAME set wins
    log.info("launching: %s", " ".join(cmd))
    # A session of its own, so that when this process is stopped (SIGTERM, Ctrl-C, a cancellation)
    # torchrun and every worker it started are stopped with it instead of training on as orphans.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        returncode = proc.wait()
    except BaseException:
        stop_process_group(proc)
        raise
    if returncode != 0:
        raise RuntimeError(f"torchrun exited with code {returncode} (its workers' logs are above)")


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is still there after the grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def join(spec_path: Path) -> None:
    """Another machine's share of a multi-machine run: the same torchrun, from the stage's launch.json."""
    spec = json.loads(spec_path.read_text())
    with training_slot(f"{spec['kind']} {spec['rdzv_id']} (joined)"):
        launch_torchrun(Config.model_validate(spec["config"]), spec_path, spec["rdzv_id"])


if __name__ == "__main__":  # python -m cpuforge.tasks.engine.training_run /shared/work/stages/<stage>-<key>.partial/launch.json
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    join(Path(sys.argv[1]))
