"""The cost of one real training step of a model shape on this machine, measured: the step timer that
model sizing, the precision A/B and the compile probe share (so what is timed is what trains), the
precision decision (`train.precision: auto`), and the cache key of a timed step."""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

import torch

from cpuforge.tasks.engine import hardware
from cpuforge.tasks.engine.optimizers import newton_schulz_dtype

log = logging.getLogger("cpuforge.hardware")


# bf16 autocast must beat fp32 by this much to be chosen: it rounds activations, so a draw is fp32's.
BF16_MIN_GAIN = 1.05
AB_ROUNDS = 3  # timed steps per precision, alternating, after one warm-up step of each
PROBE_SHARE = 0.05  # of a training's wall-clock budget, at most, that precision=auto's A/B spends
NOISY_SPREAD = 0.15  # one precision's rounds further apart than this (median over best): the machine was busy


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
        model.compile_forward()
    teacher = Llama(teacher_cfg).eval() if teacher_cfg is not None else None
    opt = build_optimizer(model, optimizer, lr=1e-5)
    # the trainer's loss: recovery's distillation (the teacher's forward and the fused head loss), else lm_loss
    loss_fn = distillation_loss(teacher, 2.0, 0.5, 0.5) if teacher is not None else lm_loss  # weights: cost-neutral

    def step(dtype: torch.dtype = torch.float32, rows: int | None = None) -> float:
        """Seconds of one step in `dtype`, on the first `rows` sequences of the batch (all by default)."""
        if hasattr(opt, "ns_dtype"):  # Muon's Newton-Schulz runs in the step's dtype, as the trainer's does
            opt.ns_dtype = newton_schulz_dtype(dtype)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = loss_fn(model, x[:rows], y[:rows])
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


def _alternate(step, dtypes: tuple[torch.dtype, ...], rows: int, rounds: int) -> tuple[dict, float]:
    """({dtype: seconds of each of `rounds` steps}, seconds spent in all, warm-ups included): one warm-up step of
    each dtype (first-call allocations, kernel selection), then rounds taken in alternation so that machine
    noise hits every dtype alike."""
    spent = sum(step(dtype, rows) for dtype in dtypes)
    seconds: dict[torch.dtype, list[float]] = {dtype: [] for dtype in dtypes}
    for _ in range(rounds):
        for dtype in dtypes:
            seconds[dtype].append(step(dtype, rows))
    return seconds, spent + sum(map(sum, seconds.values()))


def spread(seconds: list[float]) -> float:
    """How far a dtype's rounds are apart: (median - best) / best; 0 on a quiet machine."""
    return (statistics.median(seconds) - min(seconds)) / min(seconds)


def time_training_steps(model_cfg, batch: int, threads: int, dtypes: tuple[torch.dtype, ...],
                        teacher_cfg=None, rounds: int = AB_ROUNDS, optimizer: str = "adamw",
                        activation_checkpointing: bool = False) -> dict[torch.dtype, float]:
    """Tokens/s of a real training step (training_step_timer) of this model shape in each dtype, best of
    `rounds` steps taken in alternation so that machine noise hits every dtype alike."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        step = training_step_timer(model_cfg, batch, optimizer, teacher_cfg, activation_checkpointing)
        seconds, _ = _alternate(step, dtypes, batch, rounds)
        return {dtype: batch * model_cfg.block_size / min(ts) for dtype, ts in seconds.items()}
    finally:
        torch.set_num_threads(previous)


def choose_precision(requested: str, model_cfg=None, batch: int = 0, threads: int = 1,
                     cache_dir: Path | None = None, teacher_cfg=None, optimizer: str = "adamw",
                     activation_checkpointing: bool = False, budget_s: float | None = None) -> dict:
    """The training dtype, and why: {"dtype", "reason", "fp32_tok_s", "bf16_tok_s", "ab_batch", "probe_s"} (the
    figures None when not measured; ab_batch: the batch the A/B timed).

    'fp32' and 'bf16' are taken as asked. 'auto' times a few real training steps of this model
    shape in fp32 and under bf16 autocast and keeps the faster (bf16 only by BF16_MIN_GAIN or more);
    on a CPU without native bf16 (no avx512_bf16/amx_bf16) bf16 is emulated, typically tens of times
    slower, so it is not timed at all. The decision is cached per (CPU, threads, model shape, batch, optimizer,
    torch version) in <cache_dir>/precision.json: the A/B costs seconds, the cache hit nothing.

    Given the training's wall-clock budget, the A/B spends at most PROBE_SHARE of it: one step of each dtype on
    one sequence tells what a step costs; where the A/B at the run's batch would not fit, it times fewer
    sequences a step, and where not even one fits, those single steps decide. A decision from single steps, or
    from rounds further apart than NOISY_SPREAD (a busy machine), is used but not cached: the next run measures
    again, and a settled decision is never replaced by an unsettled one.
    """
    native = hardware.has_native_bf16()
    if requested in ("fp32", "bf16"):
        if requested == "bf16" and not native:
            log.warning("train.precision=bf16 on a CPU without native bf16 (no avx512_bf16/amx): expect it to be "
                        "many times slower than fp32")
        return {"dtype": "float32" if requested == "fp32" else "bfloat16", "reason": f"train.precision={requested}",
                "fp32_tok_s": None, "bf16_tok_s": None}
    if model_cfg is None or batch <= 0:
        raise ValueError("train.precision=auto measures a training step: give the model config and the batch size")
    key = step_key(model_cfg, batch, threads, teacher_cfg, optimizer, activation_checkpointing)
    cache = cache_dir / "precision.json" if cache_dir is not None else None
    known = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
    if key in known:
        decision = known[key]
        log.info("precision %s (cached A/B: %s)", decision["dtype"], decision["reason"])
        return decision
    dtypes = (torch.float32, torch.bfloat16) if native else (torch.float32,)
    if budget_s is not None:
        # Before building anything: at 1B parameters one step of one sequence takes minutes (the teacher's forward,
        # Muon's Newton-Schulz whatever the batch, the models' construction), over the share on its own.
        floor_s = single_step_floor_s(model_cfg, teacher_cfg, optimizer, threads, cache_dir, len(dtypes))
        if floor_s > PROBE_SHARE * budget_s:
            dtype = "bfloat16" if native else "float32"
            decision = {"dtype": dtype, "reason": (
                f"not timed: a step of one sequence in each precision would take at least {floor_s:.0f} s (the "
                f"shape's FLOPs at this machine's matmul peak), over {PROBE_SHARE:.0%} of the {budget_s:.0f} s "
                "budget; " + ("bf16 autocast, native on this CPU (avx512_bf16/amx)" if native else
                              "fp32: no native bf16 on this CPU")),
                "fp32_tok_s": None, "bf16_tok_s": None, "ab_batch": 0, "probe_s": 0.0}
            log.info("precision %s: %s", dtype, decision["reason"])
            return decision  # not cached: a longer budget may afford the A/B
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        started = time.perf_counter()
        step = training_step_timer(model_cfg, batch, optimizer, teacher_cfg, activation_checkpointing)
        seconds, rows, spent, why_fewer = _bounded_ab(step, dtypes, batch, budget_s, time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
    tok_s = {dtype: rows * model_cfg.block_size / min(ts) for dtype, ts in seconds.items()}
    fp32, bf16 = tok_s[torch.float32], tok_s.get(torch.bfloat16)
    if bf16 is None:
        decision = {"dtype": "float32", "reason": "no native bf16 on this CPU (no avx512_bf16/amx_bf16): bf16 not "
                                                  "timed, it is emulated and many times slower"}
    else:
        faster = bf16 >= BF16_MIN_GAIN * fp32
        decision = {"dtype": "bfloat16" if faster else "float32",
                    "reason": f"measured training step: bf16 autocast {bf16:.0f} tok/s vs fp32 {fp32:.0f} tok/s "
                              f"({bf16 / fp32:.2f}x; bf16 needs >= {BF16_MIN_GAIN:g}x)"}
    decision |= {"fp32_tok_s": round(fp32, 1), "bf16_tok_s": None if bf16 is None else round(bf16, 1),
                 "ab_batch": rows, "probe_s": round(spent, 1)}
    busy = max(spread(ts) for ts in seconds.values()) if all(len(ts) > 1 for ts in seconds.values()) else 0.0
    settled = not why_fewer.startswith("single") and busy <= NOISY_SPREAD
    if why_fewer:
        decision["reason"] += f"; {why_fewer}"
    if busy > NOISY_SPREAD:
        decision["reason"] += (f"; the machine was busy (rounds {busy:.0%} apart, over {NOISY_SPREAD:.0%}): "
                               "not kept, measured again next run")
        log.warning("precision A/B: the machine was busy (a precision's rounds %.0f%% apart): its decision is used "
                    "for this run only", 100 * busy)
    log.info("precision %s: %s", decision["dtype"], decision["reason"])
    if cache is not None and settled:
        from cpuforge.models.fileio import atomic_write_json

        atomic_write_json(cache, {**known, key: decision})
    return decision


def single_step_floor_s(model_cfg, teacher_cfg, optimizer: str, threads: int, cache_dir: Path | None,
                        precisions: int) -> float:
    """A lower bound on the seconds a one-sequence step in each of `precisions` precisions takes: its FLOPs (the
    model's forward and backward, the teacher's forward, Muon's Newton-Schulz on every block matrix) at the fp32
    and bf16 matmul peaks, the faster of the two for each; real steps run well below peak."""
    from cpuforge.models.llama import flops_per_token

    flops = flops_per_token(model_cfg) * model_cfg.block_size
    if teacher_cfg is not None:
        flops += flops_per_token(teacher_cfg, backward=False) * teacher_cfg.block_size
    if optimizer == "muon":
        flops += newton_schulz_flops(model_cfg)
    dtype = torch.bfloat16 if hardware.has_native_bf16() else torch.float32  # the faster peak: a true floor
    peak = (hardware.matmul_peak(threads, cache_dir, dtype) if cache_dir is not None
            else hardware.measure_matmul_peak(threads, dtype, hardware.peak_size(dtype)))
    return precisions * flops / peak


def newton_schulz_flops(cfg, steps: int = 5) -> float:
    """Muon's orthogonalisation of every block matrix in one optimizer step (tasks/engine/muon.py): per step
    on an m x n matrix (m <= n), X X^T, the quintic's A @ A and its product with X: 4 m^2 n + 2 m^3."""
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    shapes = [(q, cfg.d_model), (kv, cfg.d_model), (kv, cfg.d_model), (cfg.d_model, q),
              *[(cfg.d_mlp, cfg.d_model)] * 3]
    per_layer = sum(4 * min(a, b) ** 2 * max(a, b) + 2 * min(a, b) ** 3 for a, b in shapes)
    return steps * cfg.n_layer * per_layer


def _bounded_ab(step, dtypes: tuple[torch.dtype, ...], batch: int, budget_s: float | None,
                spent: float) -> tuple[dict, int, float, str]:
    """The A/B's step seconds per dtype, the sequences a step it timed, the seconds spent (`spent` already, in
    building the models), and why it timed fewer than `batch` (empty if it did not; starting "single" where
    single steps had to decide)."""
    if budget_s is None:
        seconds, more = _alternate(step, dtypes, batch, AB_ROUNDS)
        return seconds, batch, spent + more, ""
    allowance = PROBE_SHARE * budget_s
    single, more = _alternate(step, dtypes, 1, 1)
    spent += more
    per_sequence = sum(min(ts) for ts in single.values())  # a step of every dtype, one sequence each
    # A step's seconds grow at most in proportion to its sequences: the largest batch whose A/B fits what is left.
    rows = min(batch, int((allowance - spent) / ((AB_ROUNDS + 1) * per_sequence)))
    where = f"{PROBE_SHARE:.0%} of the {budget_s:.0f} s budget"
    if rows < 1:
        return single, 1, spent, (f"single steps of one sequence decided: the A/B would cost over {where} "
                                  f"(a step of one sequence in each precision: {per_sequence:.1f} s)")
    seconds, more = _alternate(step, dtypes, rows, AB_ROUNDS)
    fewer = "" if rows == batch else f"timed at {rows} of the batch's {batch} sequences a step, to stay within {where}"
    return seconds, rows, spent + more, fewer
