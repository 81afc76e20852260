"""The CPU training engine shared by pretraining and recovery (distillation).

One loop, stated plainly: budget in tokens, steps or wall-clock minutes (whichever ends
first), AdamW (or Muon for the hidden matrices, tasks/engine/muon.py) with warmup and then
cosine decay or warmup-stable-decay, gradient accumulation and clipping, periodic
validation in bits per byte, atomic checkpoints, exact resume, and DDP over gloo when
launched by torchrun.

Exact resume: the batch of (step, micro-step, rank) is a pure function of the seed and the
learning rate a pure function of the step and a horizon fixed before the first checkpoint,
so a run restarted from its checkpoint computes the same updates as one never stopped.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from pydantic import BaseModel, Field

from cpuforge.models.checkpoint import (
    latest_valid_checkpoint,
    load_training_state,
    load_weights_into,
    save_training_checkpoint,
)
from cpuforge.models.llama import Llama, flops_per_token
from cpuforge.tasks.config.settings import TrainConfig
from cpuforge.tasks.engine import sharding
from cpuforge.tasks.engine.allocator import keep_freed_memory, release_free_memory
from cpuforge.tasks.engine.data import BatchSampler
from cpuforge.tasks.engine.hardware import peak_rss_mb, reset_peak_rss
from cpuforge.tasks.engine.losses import lm_loss
from cpuforge.tasks.engine.optimizers import build_optimizer, newton_schulz_dtype
from cpuforge.tasks.engine.stop_signals import StopSignals
from cpuforge.tasks.engine.validation import autocast, evaluate

log = logging.getLogger("cpuforge.trainer")

HORIZON_PROBE_STEPS = 3  # steps timed to turn a wall-clock budget into a step horizon
# A loss function returns the loss, or (loss, {name: value}) to log its parts per step too.
LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], "torch.Tensor | tuple[torch.Tensor, dict[str, float]]"]


@dataclass(frozen=True)
class RunFacts:
    """What a training decided or measured before it started, as opposed to what was configured (the
    TrainConfig beside it): the trainer takes both, and no copy of the config's fields."""

    dtype: torch.dtype = torch.float32  # the step's precision (the precision decision)
    peak_flops: float = 0.0  # measured matmul FLOP/s per process in the step's dtype, for MFU
    # FLOPs per trained token, for MFU; 0 means the model's own forward + backward. Distillation
    # adds its teacher's forward passes, which the step computes too.
    flops_per_token: float = 0.0


class TrainingResult(BaseModel):
    """A finished training: what train() returns, and rank 0's result.json (an interface: extend, never
    rename; older files load). The per-step history is history.jsonl, never result.json."""

    steps: int
    tokens: int
    seconds: float
    tokens_per_s: float
    mfu: float
    val_loss: float
    val_bpb: float
    peak_rss_mb: float
    resumed_from: int | None = None
    compile: dict[str, Any] = {}  # the torch.compile decision it trained under (training_run: compile_params, compile_metrics)
    history: list[dict[str, Any]] = Field(default_factory=list, exclude=True)  # written as history.jsonl


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float, world: int = 1) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the measured peak of every process (0 when unknown)."""
    return tokens_per_s * flops_per_token / (peak_flops * world) if peak_flops else 0.0


def lr_at(step: int, s: TrainConfig, horizon: int) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    if s.lr_schedule == "wsd":  # hold the peak, then decay linearly over the last cooldown_fraction
        decay_start = max(s.warmup_steps, horizon - round(s.cooldown_fraction * horizon))
        if step < decay_start:
            return s.lr
        progress = min(1.0, (step - decay_start + 1) / max(1, horizon - decay_start))
        return s.lr + progress * (s.min_lr - s.lr)
    progress = min(1.0, (step - s.warmup_steps) / max(1, horizon - s.warmup_steps))
    return s.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (s.lr - s.min_lr)


def make_optimizer(model: torch.nn.Module, s: TrainConfig, dtype: torch.dtype = torch.float32) -> torch.optim.Optimizer:
    """The training's optimizer (Newton-Schulz in the step's dtype where the CPU has it natively)."""
    return build_optimizer(model, s.optimizer_in_use(), s.lr, s.muon_lr, s.weight_decay, s.betas,
                           newton_schulz_dtype(dtype))


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
    s: TrainConfig,
    checkpoint_dir: Path,
    facts: RunFacts = RunFacts(),
    loss_fn: LossFn = lm_loss,
    log_metrics: Callable[[dict[str, float], int], None] | None = None,
    on_progress: Callable[[float, str], None] | None = None,
) -> TrainingResult:
    """Train as ``s`` says (the validated train section; recovery's is made from it, training_run.py) until
    the budget is spent, resuming from the last checkpoint in checkpoint_dir if any."""
    keep_freed_memory()  # each step reuses what the last one freed instead of faulting it in again
    release_free_memory()  # not what earlier work in this process freed (model sizing's big shapes)
    reset_peak_rss()  # the history's and the result's peak_rss_mb: this training's, not the process's
    run = _Training(model, train_data, val, byte_lengths, s, facts, checkpoint_dir, loss_fn)
    run.resume()
    run.shard()
    final = run.out_of_budget()  # resumed from the last checkpoint: nothing left to do
    with StopSignals() as stops:  # a SIGTERM that torch.compile's guards swallow still stops the run
        while not final:
            record = run.step()
            stops.raise_pending()
            run.probe_horizon()
            final = run.out_of_budget()
            run.evaluate(record, due=run.step_count % s.eval_interval == 0 or final)
            run.history.append(record)
            if run.is_main:
                run.report(record, log_metrics, on_progress)
            run.checkpoint(final)
    result = run.finish()
    release_free_memory()  # the steps' activations and gradients, kept for the next step while training
    return result


class _Training:
    """One training's state, and its steps in the order train() takes them: resume, shard, step,
    probe the horizon, evaluate, report, checkpoint, finish."""

    def __init__(self, model: Llama, train_data: np.memmap, val: list[tuple[torch.Tensor, torch.Tensor]],
                 byte_lengths: np.ndarray, s: TrainConfig, facts: RunFacts, checkpoint_dir: Path,
                 loss_fn: LossFn) -> None:
        self.model, self.val, self.byte_lengths, self.s, self.facts = model, val, byte_lengths, s, facts
        self.checkpoint_dir, self.loss_fn = checkpoint_dir, loss_fn
        self.rank, self.world = _world()
        self.is_main = self.rank == 0
        self.tokens_per_step = s.batch_size * model.cfg.block_size * s.grad_accum * self.world
        self.sampler = BatchSampler(train_data, s.batch_size, model.cfg.block_size, s.seed, self.rank, self.world)
        self.step_count, self.tokens, self.elapsed_before = 0, 0, 0.0
        self.horizon: int | None = None
        self.history: list[dict[str, float]] = []
        self.resumed_from: int | None = None
        self.val_loss = self.val_bpb = float("nan")
        self.flops_per_token = facts.flops_per_token or flops_per_token(model.cfg)
        # Steps the token/step budgets allow (none: effectively unlimited, the clock decides).
        limits = [s.max_steps or 10**9]
        if s.max_tokens:
            limits.append(math.ceil(s.max_tokens / self.tokens_per_step))
        self.budget_steps = min(limits)

    def resume(self) -> None:
        """Load the last valid checkpoint, if any. Checkpoints hold the full state whatever the strategy:
        weights load into the whole model before it is sharded, the optimizer state after (shard())."""
        self.found = latest_valid_checkpoint(self.checkpoint_dir)
        self.opt_state = None
        if self.found is not None:
            if not sharding.is_sharded_checkpoint(self.found):  # a sharded one loads after the model is laid out
                load_weights_into(self.model, self.found)
            self.opt_state, state = load_training_state(self.found)
            self.step_count, self.tokens = state["step"], state["tokens"]
            self.elapsed_before, self.horizon = state["elapsed"], state["horizon"]
            self.history = state["history"]
            torch.set_rng_state(state["torch_rng"])
            self.resumed_from = self.step_count
            self._keep_checkpoint_optimizer(state.get("optimizer", "adamw"))  # older checkpoints: AdamW's
            if self.is_main:
                log.info("resuming from %s (step %d, %d tokens)", self.found.name, self.step_count, self.tokens)
        self.horizon_frozen = self.horizon is not None  # restored from a checkpoint
        if self.horizon is None and not self.s.max_minutes:
            self.horizon, self.horizon_frozen = self.budget_steps, True
        self.run_start = self.last_checkpoint = time.perf_counter()
        self.probe_start: float | None = None
        self.probe_step = self.step_count
        self.window_start, self.window_tokens = time.perf_counter(), 0

    def _keep_checkpoint_optimizer(self, written_by: str) -> None:
        """A run resumes under the optimizer that wrote its checkpoint: its state is that optimizer's, and
        train.optimizer=auto can name another after a change of strategy (fsdp -> ddp)."""
        if written_by == self.s.optimizer_in_use():
            return
        if written_by == "muon" and self.world > 1 and self.s.strategy == "fsdp":
            raise ValueError(f"{self.found} was written by Muon, which cannot run with train.strategy=fsdp on "
                             "several processes: resume it with train.strategy=ddp")
        if self.is_main:
            log.warning("%s was written by %s: resuming with %s, not %s", self.found.name, written_by, written_by,
                        self.s.optimizer_in_use())
        self.s = self.s.model_copy(update={"optimizer": written_by})

    def shard(self) -> None:
        """Lay the model out over the processes (DDP replicas or FSDP shards) and make its optimizer."""
        model, s = self.model, self.s
        self.net: torch.nn.Module = model
        if self.world > 1 and s.strategy == "fsdp":
            sharding.shard(model)  # in place: `model` is now the sharded module
        elif self.world > 1:
            # rope caches are equal everywhere: no buffers to sync
            self.net = torch.nn.parallel.DistributedDataParallel(model, forward_sync_buffers=False)
        self.optimizer = make_optimizer(model, s, self.facts.dtype)
        if self.found is not None and sharding.is_sharded_checkpoint(self.found):
            sharding.load_sharded_checkpoint(model, self.optimizer, self.found)
        elif self.opt_state is not None:
            sharding.load_optimizer_state(model, self.optimizer, self.opt_state)
        self.net.train()
        self.params = [p for p in model.parameters() if p.requires_grad]

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.run_start

    def out_of_budget(self) -> bool:
        s = self.s
        done = (s.max_steps is not None and self.step_count >= s.max_steps) or \
               (s.max_tokens is not None and self.tokens >= s.max_tokens) or \
               (self.horizon is not None and self.step_count >= self.horizon) or \
               (s.max_minutes is not None and self.elapsed() >= s.max_minutes * 60)
        if self.world > 1:  # every rank must stop at the same step; rank 0's clock decides
            flag = torch.tensor([1.0 if done else 0.0])
            dist.broadcast(flag, src=0)
            done = bool(flag.item())
        return done

    def step(self) -> dict[str, float]:
        """One optimizer step over grad_accum micro-batches; returns its history record."""
        s = self.s
        lr = lr_at(self.step_count, s, self.horizon if self.horizon is not None else 10**9)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_ratio", 1.0)
        loss_sum = 0.0
        parts: dict[str, float] = {}
        for micro in range(s.grad_accum):
            x, y = self.sampler.batch(self.step_count, micro)
            sync = self.world == 1 or micro == s.grad_accum - 1
            with sharding.gradient_sync(self.net, sync), autocast(self.facts.dtype):
                out = self.loss_fn(self.net, x, y)
                loss, named = out if isinstance(out, tuple) else (out, {})
                loss = loss / s.grad_accum
            loss.backward()
            loss_sum += loss.item()
            for name, value in named.items():
                parts[name] = parts.get(name, 0.0) + value / s.grad_accum
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        self.tokens += self.tokens_per_step
        self.window_tokens += self.tokens_per_step

        now = time.perf_counter()
        window = now - self.window_start
        tok_s = self.window_tokens / window if window > 0 else 0.0
        self.window_start, self.window_tokens = now, 0
        return {"step": self.step_count, "loss": loss_sum, **parts, "lr": lr, "grad_norm": grad_norm,
                "tokens": self.tokens, "tokens_per_s": tok_s, "mfu": self.mfu(tok_s), "elapsed": self.elapsed(),
                "peak_rss_mb": peak_rss_mb()}  # before this step's checkpoint (which gathers shards)

    def _clip_gradients(self) -> float:
        if self.s.grad_clip > 0:
            return sharding.as_float(torch.nn.utils.clip_grad_norm_(self.params, self.s.grad_clip))
        if sharding.is_sharded(self.model):  # the norm of sharded gradients needs their reduction
            return sharding.as_float(torch.nn.utils.clip_grad_norm_(self.params, float("inf")))
        return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.params if p.grad is not None])))

    def probe_horizon(self) -> None:
        """A wall-clock budget becomes a step horizon from the measured step time. It is refined until
        the first checkpoint (a busy machine can make the first steps slow) and frozen there, so the
        cosine schedule ends with the budget and a resume replays it exactly."""
        if self.horizon_frozen:
            return
        if self.probe_start is None:
            self.probe_start, self.probe_step = time.perf_counter(), self.step_count  # skip the warm-up step
        elif self.step_count - self.probe_step >= HORIZON_PROBE_STEPS:
            per_step = (time.perf_counter() - self.probe_start) / (self.step_count - self.probe_step)
            remaining = max(1, int((self.s.max_minutes * 60 - self.elapsed()) / per_step))
            self.horizon = min(self.step_count + remaining, self.budget_steps)
        if self.world > 1:  # every rank follows rank 0's clock
            self.horizon = _broadcast_int(self.horizon)

    def evaluate(self, record: dict[str, float], due: bool) -> None:
        if due:
            self.val_loss, self.val_bpb = evaluate(self.model, self.val, self.byte_lengths, self.facts.dtype)
            record.update(val_loss=self.val_loss, val_bpb=self.val_bpb)

    def report(self, record: dict[str, float], log_metrics: Callable[[dict[str, float], int], None] | None,
               on_progress: Callable[[float, str], None] | None) -> None:
        step, s = self.step_count, self.s
        if log_metrics:  # per-step series live under train/ and val/; plain names are the stage summary
            log_metrics({(f"val/{k[4:]}" if k.startswith("val_") else f"train/{k}"): v
                         for k, v in record.items() if k != "step"}, step)
        if on_progress:
            fraction = max(step / self.horizon if self.horizon else 0.0,
                           self.elapsed() / (s.max_minutes * 60) if s.max_minutes else 0.0)
            on_progress(min(1.0, fraction), f"step {step} loss {record['loss']:.3f}")
        if "val_bpb" in record:
            log.info("step %d: loss %.4f, val loss %.4f, val bpb %.4f, %.0f tok/s, MFU %.1f%%",
                     step, record["loss"], self.val_loss, self.val_bpb, record["tokens_per_s"], 100 * record["mfu"])

    def checkpoint(self, final: bool) -> None:
        s, step = self.s, self.step_count
        now = time.perf_counter()
        due = self.horizon is not None and (
            step % s.checkpoint_every_steps == 0 or now - self.last_checkpoint >= s.checkpoint_every_minutes * 60
            or final)
        if self.world > 1:
            due = bool(_broadcast_int(int(due)))
        if not due:
            return
        if not self.horizon_frozen:
            self.horizon_frozen = True
            if self.is_main:
                log.info("wall-clock budget of %.1f min -> %s schedule's horizon fixed at %d steps", s.max_minutes,
                         s.lr_schedule, self.horizon)
        state = {"step": step, "tokens": self.tokens, "elapsed": self.elapsed(), "horizon": self.horizon,
                 "history": self.history, "torch_rng": torch.get_rng_state(), "optimizer": self.s.optimizer_in_use()}
        if sharding.is_sharded(self.model):  # every rank writes its own shards
            sharding.save_sharded_checkpoint(self.checkpoint_dir, step, self.model, self.optimizer, state)
        elif self.is_main:
            save_training_checkpoint(self.checkpoint_dir, step, self.model,
                                     sharding.full_optimizer_state(self.model, self.optimizer), state)
        self.last_checkpoint = time.perf_counter()

    def mfu(self, tokens_per_s: float) -> float:
        return mfu(tokens_per_s, self.flops_per_token, self.facts.peak_flops, self.world)

    def finish(self) -> TrainingResult:
        if self.world > 1:
            dist.barrier()
        if math.isnan(self.val_loss):  # resumed at the very end: nothing left to train, still report quality
            self.val_loss, self.val_bpb = evaluate(self.model, self.val, self.byte_lengths, self.facts.dtype)
        steady = [h["tokens_per_s"] for h in self.history[1:]] or [h["tokens_per_s"] for h in self.history]
        tok_s = float(np.median(steady)) if steady else 0.0
        return TrainingResult(
            steps=self.step_count, tokens=self.tokens, seconds=self.elapsed(), tokens_per_s=tok_s, mfu=self.mfu(tok_s),
            val_loss=self.val_loss, val_bpb=self.val_bpb, peak_rss_mb=peak_rss_mb(), resumed_from=self.resumed_from,
            history=self.history,
        )
