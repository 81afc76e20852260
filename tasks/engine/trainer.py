"""The CPU training engine shared by pretraining and recovery (distillation).

One loop, stated plainly: budget in tokens, steps or wall-clock minutes (whichever ends
first), AdamW with warmup + cosine decay, gradient accumulation and clipping, periodic
validation in bits per byte, atomic checkpoints, exact resume, and DDP over gloo when
launched by torchrun.

Exact resume: the batch of (step, micro-step, rank) is a pure function of the seed and the
learning rate a pure function of the step and a horizon fixed before the first checkpoint,
so a run restarted from its checkpoint computes the same updates as one never stopped.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpuforge.models.checkpoint import (
    latest_valid_checkpoint,
    load_training_state,
    load_weights_into,
    save_training_checkpoint,
)
from cpuforge.models.llama import Llama, flops_per_token
from cpuforge.tasks.engine import sharding
from cpuforge.tasks.engine.data import BatchSampler, bits_per_byte
from cpuforge.tasks.engine.hardware import peak_rss_mb

log = logging.getLogger("cpuforge.trainer")

HORIZON_PROBE_STEPS = 3  # steps timed to turn a wall-clock budget into a step horizon
# A loss function returns the loss, or (loss, {name: value}) to log its parts per step too.
LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], "torch.Tensor | tuple[torch.Tensor, dict[str, float]]"]


@dataclass
class TrainSettings:
    batch_size: int
    grad_accum: int
    lr: float
    min_lr: float
    warmup_steps: int
    weight_decay: float
    betas: tuple[float, float]
    grad_clip: float
    max_tokens: int | None
    max_steps: int | None
    max_minutes: float | None
    eval_interval: int
    checkpoint_every_steps: int
    checkpoint_every_minutes: float
    seed: int
    dtype: torch.dtype = torch.float32
    peak_flops: float = 0.0  # measured matmul FLOP/s per process in the step's dtype, for MFU
    # FLOPs per trained token, for MFU; 0 means the model's own forward + backward. Distillation
    # adds its teacher's forward passes, which the step computes too.
    flops_per_token: float = 0.0
    strategy: str = "ddp"  # with several processes: "ddp" (replicas) or "fsdp" (shards), see tasks/engine/sharding.py


@dataclass
class TrainResult:
    steps: int
    tokens: int
    seconds: float
    tokens_per_s: float
    mfu: float
    val_loss: float
    val_bpb: float
    peak_rss_mb: float
    resumed_from: int | None
    history: list[dict[str, float]] = field(default_factory=list)


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits, _ = model(x)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))


def distillation_loss(teacher: torch.nn.Module, temperature: float, kd_weight: float, lm_weight: float):
    """Knowledge distillation: KL to the teacher's softened distribution plus the usual LM loss."""
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


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float, world: int = 1) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the measured peak of every process (0 when unknown)."""
    return tokens_per_s * flops_per_token / (peak_flops * world) if peak_flops else 0.0


def lr_at(step: int, s: TrainSettings, horizon: int) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = min(1.0, (step - s.warmup_steps) / max(1, horizon - s.warmup_steps))
    return s.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (s.lr - s.min_lr)


def make_optimizer(model: torch.nn.Module, s: TrainSettings) -> torch.optim.AdamW:
    """Weight decay on matrices only (not norms); one parameter per tied pair."""
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s.lr, betas=s.betas, foreach=True)


@torch.no_grad()
def evaluate(model: Llama, batches: list[tuple[torch.Tensor, torch.Tensor]], byte_lengths: np.ndarray,
             dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """(mean loss per token, bits per byte) over fixed validation batches."""
    was_training = model.training
    model.eval()
    nll, tokens, n_bytes = 0.0, 0, 0
    lengths = torch.from_numpy(byte_lengths)
    for x, y in batches:
        with _autocast(dtype):
            logits, _ = model(x)
        nll += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1), reduction="sum").item()
        tokens += y.numel()
        n_bytes += int(lengths[y].sum())
    model.train(was_training)
    return nll / tokens, bits_per_byte(nll, n_bytes)


def _autocast(dtype: torch.dtype):
    if dtype == torch.bfloat16:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _broadcast_int(value: int | None) -> int | None:
    """Rank 0's value on every rank (None travels as -1)."""
    t = torch.tensor([-1 if value is None else value], dtype=torch.int64)
    dist.broadcast(t, src=0)
    return None if t.item() == -1 else int(t.item())


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def train(
    model: Llama,
    train_data: np.memmap,
    val: list[tuple[torch.Tensor, torch.Tensor]],
    byte_lengths: np.ndarray,
    s: TrainSettings,
    checkpoint_dir: Path,
    loss_fn: LossFn = lm_loss,
    log_metrics: Callable[[dict[str, float], int], None] | None = None,
    on_progress: Callable[[float, str], None] | None = None,
) -> TrainResult:
    rank, world = _world()
    is_main = rank == 0
    T = model.cfg.block_size
    tokens_per_step = s.batch_size * T * s.grad_accum * world
    sampler = BatchSampler(train_data, s.batch_size, T, s.seed, rank, world)
    step, tokens, elapsed_before, horizon, history, resumed_from = 0, 0, 0.0, None, [], None

    # Checkpoints hold the full state whatever the strategy: weights load into the whole model
    # before it is sharded, the optimizer state (keyed by parameter name) after.
    found = latest_valid_checkpoint(checkpoint_dir)
    opt_state = None
    if found is not None:
        if not sharding.is_sharded_checkpoint(found):  # a sharded one loads after the model is laid out
            load_weights_into(model, found)
        opt_state, trainer_state = load_training_state(found)
        step, tokens = trainer_state["step"], trainer_state["tokens"]
        elapsed_before, horizon = trainer_state["elapsed"], trainer_state["horizon"]
        history = trainer_state["history"]
        torch.set_rng_state(trainer_state["torch_rng"])
        resumed_from = step
        if is_main:
            log.info("resuming from %s (step %d, %d tokens)", found.name, step, tokens)

    net: torch.nn.Module = model
    if world > 1 and s.strategy == "fsdp":
        sharding.shard(model)  # in place: `model` is now the sharded module
    elif world > 1:
        net = torch.nn.parallel.DistributedDataParallel(model, forward_sync_buffers=False)  # rope caches are equal everywhere
    optimizer = make_optimizer(model, s)
    if found is not None and sharding.is_sharded_checkpoint(found):
        sharding.load_sharded_checkpoint(model, optimizer, found)
    elif opt_state is not None:
        sharding.load_optimizer_state(model, optimizer, opt_state)
    net.train()
    params = [p for p in model.parameters() if p.requires_grad]
    flops_tok = s.flops_per_token or flops_per_token(model.cfg)

    def mfu_at(tokens_per_s: float) -> float:
        return mfu(tokens_per_s, flops_tok, s.peak_flops, world)

    # Steps the token/step budgets allow (none: effectively unlimited, the clock decides).
    limits = [s.max_steps or 10**9]
    if s.max_tokens:
        limits.append(math.ceil(s.max_tokens / tokens_per_step))
    budget_steps = min(limits)
    horizon_frozen = horizon is not None  # restored from a checkpoint
    if horizon is None and not s.max_minutes:
        horizon, horizon_frozen = budget_steps, True
    run_start = time.perf_counter()
    last_checkpoint = run_start
    probe_start, probe_step = None, step
    window_start, window_tokens = time.perf_counter(), 0
    val_loss = val_bpb = float("nan")

    def elapsed() -> float:
        return elapsed_before + time.perf_counter() - run_start

    def out_of_budget() -> bool:
        done = (s.max_steps is not None and step >= s.max_steps) or \
               (s.max_tokens is not None and tokens >= s.max_tokens) or \
               (horizon is not None and step >= horizon) or \
               (s.max_minutes is not None and elapsed() >= s.max_minutes * 60)
        if world > 1:  # every rank must stop at the same step; rank 0's clock decides
            flag = torch.tensor([1.0 if done else 0.0])
            dist.broadcast(flag, src=0)
            done = bool(flag.item())
        return done

    final = out_of_budget()  # resumed from the last checkpoint: nothing left to do
    while not final:
        lr = lr_at(step, s, horizon if horizon is not None else 10**9)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        parts: dict[str, float] = {}
        for micro in range(s.grad_accum):
            x, y = sampler.batch(step, micro)
            sync = world == 1 or micro == s.grad_accum - 1
            with sharding.gradient_sync(net, sync), _autocast(s.dtype):
                out = loss_fn(net, x, y)
                loss, named = out if isinstance(out, tuple) else (out, {})
                loss = loss / s.grad_accum
            loss.backward()
            loss_sum += loss.item()
            for name, value in named.items():
                parts[name] = parts.get(name, 0.0) + value / s.grad_accum
        if s.grad_clip > 0:
            grad_norm = sharding.as_float(torch.nn.utils.clip_grad_norm_(params, s.grad_clip))
        elif sharding.is_sharded(model):  # the norm of sharded gradients needs their reduction
            grad_norm = sharding.as_float(torch.nn.utils.clip_grad_norm_(params, float("inf")))
        else:
            grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens += tokens_per_step
        window_tokens += tokens_per_step

        # A wall-clock budget becomes a step horizon from the measured step time. It is refined
        # until the first checkpoint (a busy machine can make the first steps slow) and frozen
        # there, so the cosine schedule ends with the budget and a resume replays it exactly.
        if not horizon_frozen:
            if probe_start is None:
                probe_start, probe_step = time.perf_counter(), step  # skip the first (warm-up) step
            elif step - probe_step >= HORIZON_PROBE_STEPS:
                per_step = (time.perf_counter() - probe_start) / (step - probe_step)
                remaining = max(1, int((s.max_minutes * 60 - elapsed()) / per_step))
                horizon = min(step + remaining, budget_steps)
            if world > 1:  # every rank follows rank 0's clock
                horizon = _broadcast_int(horizon)

        now = time.perf_counter()
        window = now - window_start
        tok_s = window_tokens / window if window > 0 else 0.0
        step_mfu = mfu_at(tok_s)
        window_start, window_tokens = now, 0
        record = {"step": step, "loss": loss_sum, **parts, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                  "tokens_per_s": tok_s, "mfu": step_mfu, "elapsed": elapsed(),
                  "peak_rss_mb": peak_rss_mb()}  # before this step's checkpoint (which gathers shards)
        final = out_of_budget()
        if step % s.eval_interval == 0 or final:
            val_loss, val_bpb = evaluate(model, val, byte_lengths, s.dtype)
            record.update(val_loss=val_loss, val_bpb=val_bpb)
        history.append(record)
        if is_main:
            if log_metrics:  # per-step series live under train/ and val/; plain names are the stage summary
                log_metrics({(f"val/{k[4:]}" if k.startswith("val_") else f"train/{k}"): v
                             for k, v in record.items() if k != "step"}, step)
            if on_progress:
                fraction = max(step / horizon if horizon else 0.0,
                               elapsed() / (s.max_minutes * 60) if s.max_minutes else 0.0)
                on_progress(min(1.0, fraction), f"step {step} loss {loss_sum:.3f}")
            if "val_bpb" in record:
                log.info("step %d: loss %.4f, val loss %.4f, val bpb %.4f, %.0f tok/s, MFU %.1f%%",
                         step, loss_sum, val_loss, val_bpb, tok_s, 100 * step_mfu)
        checkpoint_now = horizon is not None and (
            step % s.checkpoint_every_steps == 0 or now - last_checkpoint >= s.checkpoint_every_minutes * 60 or final)
        if world > 1:
            checkpoint_now = bool(_broadcast_int(int(checkpoint_now)))
        if checkpoint_now and not horizon_frozen:
            horizon_frozen = True
            if is_main:
                log.info("wall-clock budget of %.1f min -> cosine horizon fixed at %d steps", s.max_minutes, horizon)
        if checkpoint_now:
            trainer_state = {"step": step, "tokens": tokens, "elapsed": elapsed(), "horizon": horizon,
                             "history": history, "torch_rng": torch.get_rng_state()}
            if sharding.is_sharded(model):  # every rank writes its own shards
                sharding.save_sharded_checkpoint(checkpoint_dir, step, model, optimizer, trainer_state)
            elif is_main:
                save_training_checkpoint(checkpoint_dir, step, model,
                                         sharding.full_optimizer_state(model, optimizer), trainer_state)
            last_checkpoint = time.perf_counter()

    if world > 1:
        dist.barrier()
    if math.isnan(val_loss):  # resumed at the very end: nothing left to train, still report quality
        val_loss, val_bpb = evaluate(model, val, byte_lengths, s.dtype)
    seconds = elapsed()
    steady = [h["tokens_per_s"] for h in history[1:]] or [h["tokens_per_s"] for h in history]
    tok_s = float(np.median(steady)) if steady else 0.0
    return TrainResult(
        steps=step, tokens=tokens, seconds=seconds, tokens_per_s=tok_s,
        mfu=mfu_at(tok_s),
        val_loss=val_loss, val_bpb=val_bpb, peak_rss_mb=peak_rss_mb(), resumed_from=resumed_from, history=history,
    )
