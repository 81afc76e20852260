"""The cost of one real training step of a model shape on this machine, measured: the step timer that
model sizing, the precision A/B and the compile probe share (so what is timed is what trains), the
precision decision (`train.precision: auto`), and the cache key of a timed step."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from cpuforge.tasks.engine import hardware
from cpuforge.tasks.engine.optimizers import newton_schulz_dtype

log = logging.getLogger("cpuforge.hardware")


# bf16 autocast must beat fp32 by this much to be chosen: it rounds activations, so a draw is fp32's.
BF16_MIN_GAIN = 1.05
AB_ROUNDS = 3  # timed steps per precision, alternating, after one warm-up step of each


def training_step_timer(model_cfg, batch: int, optimizer: str = "adamw", teacher_cfg=None,
                        activation_checkpointing: bool = False, compiled: bool = False):
    """A function dtype -> seconds of one real training step of this model shape as the run will take it:
    forward and the trainer's loss (the sliced cross-entropy; with a teacher, recovery's distillation loss:
    the teacher's forward, both models' logits fused at the student's head), backward (recomputing activations
    under activation checkpointing) and the run's optimizer (AdamW, or Muon for the blocks' matrices, its Newton-Schulz in the step's
    precision), bf16 meaning autocast as the trainer runs it; ``compiled``: with the model's forward under
    torch.compile, as train.compile does it (the first step compiles). Call it under the thread count being
    measured."""
    from cpuforge.models.llama import Llama
    from cpuforge.tasks.engine.allocator import keep_freed_memory
    from cpuforge.tasks.engine.losses import distillation_loss, lm_loss
    from cpuforge.tasks.engine.optimizers import build_optimizer

    keep_freed_memory()  # as the trainer runs: the step's rate depends on it (tasks/engine/allocator.py)

    g = torch.Generator().manual_seed(0)
    xy = torch.randint(0, model_cfg.vocab_size, (batch, model_cfg.block_size + 1), generator=g)
    x, y = xy[:, :-1], xy[:, 1:]  # views of one window, strided as the trainer's batches are (data.BatchSampler)
    model = Llama(model_cfg)
    model.activation_checkpointing = activation_checkpointing
    if compiled:
        model.forward = torch.compile(model.forward)  # type: ignore[method-assign]
    teacher = Llama(teacher_cfg).eval() if teacher_cfg is not None else None
    opt = build_optimizer(model, optimizer, lr=1e-5)
    # the trainer's loss: recovery's distillation (the teacher's forward and the fused head loss), else lm_loss
    loss_fn = distillation_loss(teacher, 2.0, 0.5, 0.5) if teacher is not None else lm_loss  # weights: cost-neutral

    def step(dtype: torch.dtype = torch.float32) -> float:
        if hasattr(opt, "ns_dtype"):  # Muon's Newton-Schulz runs in the step's dtype, as the trainer's does
            opt.ns_dtype = newton_schulz_dtype(dtype)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = loss_fn(model, x, y)
            loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    return step


def step_signature(optimizer: str, activation_checkpointing: bool) -> str:
    """What, besides the shape, decides a timed step's cost: a measurement cache's key part."""
    return optimizer + ("|recompute" if activation_checkpointing else "")


def step_key(model_cfg, batch: int, threads: int, teacher_cfg=None, optimizer: str = "adamw",
             activation_checkpointing: bool = False) -> str:
    """A measurement cache's key for one training step on this machine: CPU, threads, the model's and the
    teacher's shapes, batch, optimizer and recompute, torch version."""
    shape = json.dumps(model_cfg.to_dict(), sort_keys=True)
    # "fused:": steps timed with the distillation loss that made full logits (a slower step) are not reused
    teacher = "fused:" + json.dumps(teacher_cfg.to_dict(), sort_keys=True) if teacher_cfg is not None else "-"
    step = step_signature(optimizer, activation_checkpointing)
    return f"{hardware.cpu_model()}|{threads}|{shape}|{teacher}|{batch}|{step}|{torch.__version__}"


def time_training_steps(model_cfg, batch: int, threads: int, dtypes: tuple[torch.dtype, ...],
                        teacher_cfg=None, rounds: int = AB_ROUNDS, optimizer: str = "adamw",
                        activation_checkpointing: bool = False) -> dict[torch.dtype, float]:
    """Tokens/s of a real training step (training_step_timer) of this model shape in each dtype, best of
    `rounds` steps taken in alternation so that machine noise hits every dtype alike."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        step = training_step_timer(model_cfg, batch, optimizer, teacher_cfg, activation_checkpointing)
        for dtype in dtypes:  # warm-up: first-call allocations and kernel selection
            step(dtype)
        best = {dtype: float("inf") for dtype in dtypes}
        for _ in range(rounds):
            for dtype in dtypes:
                best[dtype] = min(best[dtype], step(dtype))
        return {dtype: batch * model_cfg.block_size / seconds for dtype, seconds in best.items()}
    finally:
        torch.set_num_threads(previous)


def choose_precision(requested: str, model_cfg=None, batch: int = 0, threads: int = 1,
                     cache_dir: Path | None = None, teacher_cfg=None, optimizer: str = "adamw",
                     activation_checkpointing: bool = False) -> dict:
    """The training dtype, and why: {"dtype", "reason", "fp32_tok_s", "bf16_tok_s"} (the figures are
    None when not measured).

    'fp32' and 'bf16' are taken as asked. 'auto' times a few real training steps of this model
    shape in fp32 and under bf16 autocast and keeps the faster (bf16 only by BF16_MIN_GAIN or more);
    on a CPU without native bf16 (no avx512_bf16/amx_bf16) bf16 is emulated, typically tens of times
    slower, so it is not timed at all. The decision is cached per (CPU, threads, model shape, batch, optimizer,
    torch version) in <cache_dir>/precision.json: the A/B costs seconds, the cache hit nothing.
    """
    native = hardware.has_native_bf16()
    if requested == "fp32":
        return {"dtype": "float32", "reason": "train.precision=fp32", "fp32_tok_s": None, "bf16_tok_s": None}
    if requested == "bf16":
        if not native:
            log.warning("train.precision=bf16 on a CPU without native bf16 (no avx512_bf16/amx): expect it to be "
                        "many times slower than fp32")
        return {"dtype": "bfloat16", "reason": "train.precision=bf16", "fp32_tok_s": None, "bf16_tok_s": None}
    if model_cfg is None or batch <= 0:
        raise ValueError("train.precision=auto measures a training step: give the model config and the batch size")
    key = step_key(model_cfg, batch, threads, teacher_cfg, optimizer, activation_checkpointing)
    cache = cache_dir / "precision.json" if cache_dir is not None else None
    known = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
    if key in known:
        decision = known[key]
        log.info("precision %s (cached A/B: %s)", decision["dtype"], decision["reason"])
        return decision
    if not native:
        fp32 = time_training_steps(model_cfg, batch, threads, (torch.float32,), teacher_cfg, optimizer=optimizer,
                                   activation_checkpointing=activation_checkpointing)[torch.float32]
        decision = {"dtype": "float32", "fp32_tok_s": round(fp32, 1), "bf16_tok_s": None,
                    "reason": "no native bf16 on this CPU (no avx512_bf16/amx_bf16): bf16 not timed, it is emulated "
                              "and many times slower"}
    else:
        rates = time_training_steps(model_cfg, batch, threads, (torch.float32, torch.bfloat16), teacher_cfg,
                                    optimizer=optimizer, activation_checkpointing=activation_checkpointing)
        fp32, bf16 = rates[torch.float32], rates[torch.bfloat16]
        faster = bf16 >= BF16_MIN_GAIN * fp32
        decision = {"dtype": "bfloat16" if faster else "float32", "fp32_tok_s": round(fp32, 1),
                    "bf16_tok_s": round(bf16, 1),
                    "reason": f"measured training step: bf16 autocast {bf16:.0f} tok/s vs fp32 {fp32:.0f} tok/s "
                              f"({bf16 / fp32:.2f}x; bf16 needs >= {BF16_MIN_GAIN:g}x)"}
    log.info("precision %s: %s", decision["dtype"], decision["reason"])
    if cache is not None:
        from cpuforge.models.fileio import atomic_write_json

        atomic_write_json(cache, {**known, key: decision})
    return decision
