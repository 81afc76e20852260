"""`model.size: auto`: the model shape that lands a pretraining budget near compute-optimal on this machine.

A wall-clock budget buys a number of tokens that depends on the shape (a smaller model steps faster),
so the choice needs this machine's training speed per shape. It is measured once per (CPU, threads,
batch, context, vocabulary, precision, optimizer, activation checkpointing, torch version): a few real training steps of each rung of
models/config.py AUTO_LADDER, taken in alternation (round-robin, best of N) so that load from other
processes hits every shape alike, and cached in <workdir>/cache/size_throughput.json. The cache keeps
the first measurement: repeated runs (and `cpuforge plan`) choose the same shape and hit the stage cache.

The choice: the rung whose expected tokens per parameter within the budget is closest to TOKENS_PER_PARAM
(the sweet spot found by benchmarks/size_sweep.py at equal wall-clock on the demo corpus); any model field
the user set stays as set, the rungs only fill the others. It is made before any stage key is computed
(flows/session.py for a run, flows/plan.py for `cpuforge plan`), so the pretrain key holds the shape.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cpuforge.models.config import AUTO_LADDER, LlamaConfig, ModelConfigError, ladder_shape
from cpuforge.models.llama import config_param_count, flops_per_token
from cpuforge.tasks.config.settings import AUTO_FIELDS as _AUTO_FIELDS
from cpuforge.tasks.records.errors import ConfigError

log = logging.getLogger("cpuforge.sizing")

# Tokens per parameter at which validation bits per byte was lowest at equal wall-clock in
# benchmarks/size_sweep.py (stdlib demo corpus, vocab 4096, context 256, the demo profile's recipe, 2 cores).
# 5-minute budget, Xeon with AMX, bf16, Muon: 2.63M params on 1.5 tokens/param, val bpb 1.3165, against 1.26M on 4.5
# (1.3284), the 4.0M demo shape on 0.8 (1.3583) and 8.9M on 0.2 (1.5865). 1-minute budget, AVX2 EPYC, fp32
# (AdamW then): 0.89M on 0.52 (2.281) beat 1.26M on 0.20 and 4.0M on 0.03, and its 0.37M shape (2 tokens/param)
# did not finish, so 0.52 was a lower bound there. Far below Chinchilla's ~20: at this scale the tied
# 4096-token embedding is most of the parameters.
TOKENS_PER_PARAM = 1.5
MEASURE_ROUNDS = 3  # timed steps per shape, round-robin, after one warm-up step of each
# Shapes whose warm-up step takes longer than this are not timed (after the first MIN_MEASURED, so that a
# busy machine still measures a few): their speed is extrapolated from the largest measured shape's FLOP
# rate at their FLOPs per token (bigger shapes usually reach a higher one, so it errs on the small side).
MAX_MEASURED_STEP_S = 6.0
MIN_MEASURED = 4
CACHE_FILE = "size_throughput.json"


@dataclass(frozen=True)
class SizeChoice:
    shape: LlamaConfig
    params: int
    tokens_per_s: float
    expected_tokens: int
    tokens_per_param: float
    reason: str

    def as_params(self) -> dict[str, Any]:
        """What pretrain logs to MLflow about the choice."""
        return {"size_auto": True, "size_auto_reason": self.reason[:500],
                "size_auto_shape": json.dumps({k: getattr(self.shape, k) for k in
                                               ("n_layer", "d_model", "n_head", "n_kv_head", "d_mlp")})}

    def as_metrics(self) -> dict[str, float]:
        return {"size_auto_params": self.params, "size_auto_tokens_per_s": round(self.tokens_per_s, 1),
                "size_auto_expected_tokens": self.expected_tokens,
                "size_auto_tokens_per_param": round(self.tokens_per_param, 2)}


def candidate_shapes(base: dict[str, Any], fixed: dict[str, Any], vocab_size: int) -> list[LlamaConfig]:
    """The ladder's rungs with the user's fixed fields applied, smallest first (invalid combinations
    dropped, duplicates once: fixing n_layer makes rungs that differ only in depth the same)."""
    out: list[LlamaConfig] = []
    for d_model, n_layer in AUTO_LADDER:
        # A fixed width carries its own heads and MLP width; a fixed head count its own KV heads.
        fields = {**base, **ladder_shape(fixed.get("d_model", d_model), fixed.get("n_layer", n_layer)), **fixed}
        if "n_head" in fixed and "n_kv_head" not in fixed:
            fields["n_kv_head"] = fixed["n_head"] // 2 if fixed["n_head"] % 2 == 0 else fixed["n_head"]
        try:
            cfg = LlamaConfig(vocab_size=vocab_size, **fields)
        except ModelConfigError:
            continue
        if cfg not in out:
            out.append(cfg)
    return sorted(out, key=config_param_count)


def measure_shapes(shapes: list[LlamaConfig], batch: int, threads: int, dtype: torch.dtype = torch.float32,
                   rounds: int = MEASURE_ROUNDS, max_step_s: float | None = None,
                   optimizer: str = "adamw", activation_checkpointing: bool = False) -> list[float | None]:
    """Training tokens/s (step_timing.training_step_timer: the step as the run takes it) of each shape, best
    of `rounds` steps taken round-robin across the shapes. With max_step_s, a shape whose warm-up step took longer
    (and every larger one after it) is not timed, once MIN_MEASURED are: None."""
    from cpuforge.tasks.engine.allocator import release_free_memory
    from cpuforge.tasks.engine.step_timing import training_step_timer

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    timed: list = []
    step = None
    try:
        # Warm-up: first-call allocations and kernel selection. Shapes are built one by one, so a shape
        # too slow to time stops the ladder before its bigger rungs take memory.
        for cfg in shapes:
            step = training_step_timer(cfg, batch, optimizer, activation_checkpointing=activation_checkpointing)
            if step(dtype) > (max_step_s or math.inf) and len(timed) >= MIN_MEASURED:
                break
            timed.append((cfg, step))
        best = [math.inf] * len(timed)
        for _ in range(rounds):
            for i, (_, step) in enumerate(timed):
                best[i] = min(best[i], step(dtype))
        rates: list[float | None] = [batch * cfg.block_size / s for (cfg, _), s in zip(timed, best)]
        return rates + [None] * (len(shapes) - len(timed))
    finally:
        torch.set_num_threads(previous)
        # The shapes, their optimizers and activations: freed, then given back to the OS, or the run's process
        # keeps the biggest shape's gigabytes through every stage after it (the allocator is set to keep them).
        timed.clear()
        step = None  # noqa: F841 (drops the last shape's step, which holds its model)
        release_free_memory()


def throughput(shapes: list[LlamaConfig], batch: int, threads: int, dtype: torch.dtype,
               cache_dir: Path | None, optimizer: str = "adamw", activation_checkpointing: bool = False) -> list[float]:
    """Tokens/s of each shape on this machine: measured (cached) where a step is cheap, else extrapolated
    at the FLOP rate of the largest measured shape (bigger shapes usually run at a higher one, so this
    errs towards a smaller model)."""
    from cpuforge.tasks.engine.hardware import cpu_model
    from cpuforge.tasks.engine.step_timing import step_signature

    cache = cache_dir / CACHE_FILE if cache_dir is not None else None
    known = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
    step = step_signature(optimizer, activation_checkpointing)
    prefix = f"{cpu_model()}|{threads}|{batch}|{dtype}|{step}|{torch.__version__}"
    keys = [f"{prefix}|{json.dumps(s.to_dict(), sort_keys=True)}" for s in shapes]
    missing = [i for i, k in enumerate(keys) if k not in known]
    if missing:
        log.info("model.size=auto: timing training steps of %d candidate shapes on this machine (once; cached in %s)",
                 len(missing), cache or "memory")
        rates = measure_shapes([shapes[i] for i in missing], batch, threads, dtype, max_step_s=MAX_MEASURED_STEP_S,
                               optimizer=optimizer, activation_checkpointing=activation_checkpointing)
        for i, rate in zip(missing, rates):
            known[keys[i]] = rate
        if cache is not None:
            from cpuforge.models.fileio import atomic_write_json

            atomic_write_json(cache, known)
    measured = [(flops_per_token(s), known[k]) for s, k in zip(shapes, keys) if known[k]]
    if not measured:
        raise RuntimeError("model.size=auto: no candidate shape could be timed on this machine")
    flops, rate = max(measured)
    flop_rate = flops * rate
    return [known[k] or flop_rate / flops_per_token(s) for s, k in zip(shapes, keys)]


def token_budget(tokens_per_s: float, max_minutes: float | None, max_tokens: int | None,
                 max_steps: int | None, tokens_per_step: int) -> int:
    """Tokens a training at this speed sees before the first of its budgets runs out."""
    limits = []
    if max_minutes is not None:
        limits.append(max_minutes * 60 * tokens_per_s)
    if max_tokens is not None:
        limits.append(max_tokens)
    if max_steps is not None:
        limits.append(max_steps * tokens_per_step)
    return int(min(limits))


def describe(shape: LlamaConfig, rate: float, budget: dict[str, Any], note: str = "") -> SizeChoice:
    """The expected tokens and tokens/param of training this shape at this speed within the budget.
    `budget`: max_minutes, max_tokens, max_steps, tokens_per_step."""
    tokens = token_budget(rate, **budget)
    params = config_param_count(shape)
    spent = ", ".join(f"{k}={v:g}" for k, v in budget.items() if v is not None and k != "tokens_per_step")
    reason = (f"{params / 1e6:.2f}M params, {shape.n_layer} layers x d_model {shape.d_model}: at {rate:,.0f} training "
              f"tok/s measured on this machine the budget ({spent}) buys ~{tokens:,} tokens, {tokens / params:.1f} "
              f"tokens/param (target {TOKENS_PER_PARAM:g}){note}")
    return SizeChoice(shape, params, rate, tokens, tokens / params, reason)


def choose(shapes: list[LlamaConfig], rates: list[float], budget: dict[str, Any],
           target: float = TOKENS_PER_PARAM) -> SizeChoice:
    """The shape whose expected tokens per parameter within the budget is closest to `target` (by ratio:
    2x too many tokens counts like 2x too few). A bigger budget or a faster machine buys more tokens, so
    the choice moves up the ladder."""
    options = [describe(shape, rate, budget) for shape, rate in zip(shapes, rates)]
    best = min(options, key=lambda o: abs(math.log(max(o.tokens_per_param, 1e-9) / target)))
    note = f"; the closest of {len(shapes)} candidate shapes ({options[0].params / 1e6:.2f}M-{options[-1].params / 1e6:.2f}M)"
    return describe(best.shape, best.tokens_per_s, budget, note)


def train_budget(train: Any, block_size: int) -> dict[str, Any]:
    """A TrainConfig's budgets, as describe() and choose() take them."""
    world = train.nproc_per_node * train.nnodes
    return {"max_minutes": train.max_minutes, "max_tokens": train.max_tokens, "max_steps": train.max_steps,
            "tokens_per_step": train.batch_size * train.grad_accum * block_size * world}


def training_dtype(precision: str) -> torch.dtype:
    """The dtype the trainer will most likely run (train.precision=auto picks bf16 where the CPU has it
    natively and it measures faster, which on such CPUs it typically does)."""
    from cpuforge.tasks.engine.hardware import has_native_bf16

    return torch.bfloat16 if precision == "bf16" or (precision == "auto" and has_native_bf16()) else torch.float32


def _rates(shapes: list[LlamaConfig], train: Any, cache_dir: Path | None) -> list[float]:
    """Whole-run tokens/s: one process's measured rate times the processes (DDP scales about so)."""
    from cpuforge.tasks.engine.training_run import threads_per_process, world_size

    per_process = throughput(shapes, train.batch_size, threads_per_process(train), training_dtype(train.precision),
                             cache_dir, train.optimizer_in_use(), train.activation_checkpointing)
    return [rate * world_size(train) for rate in per_process]


def resolve_auto_size(cfg: Any, workdir: Path | str) -> tuple[Any, SizeChoice | None]:
    """The config with `model.size: auto`'s empty shape fields chosen (and the choice), or the config as
    it is (and None) when nothing is left to choose. Called where a run starts and by `cpuforge plan`,
    before any stage key is computed: the pretrain key holds the chosen shape."""
    model = cfg.model
    if not model.unresolved:
        return cfg, None
    data = model.model_dump()
    fixed = {k: data[k] for k in data if k != "size" and data[k] is not None and k in _AUTO_FIELDS}
    base = {k: data[k] for k in data if k != "size" and k not in _AUTO_FIELDS}
    vocab = planned_vocab_size(cfg)
    shapes = candidate_shapes(base, fixed, vocab)
    if not shapes:
        raise ConfigError(f"model.size=auto: no candidate shape fits the fixed fields {fixed}; set the whole shape")
    choice = choose(shapes, _rates(shapes, cfg.train, Path(workdir) / "cache"), train_budget(cfg.train, model.block_size))
    log.info("model.size=auto chose %s", choice.reason)
    chosen = type(model)(size=model.size, **{k: getattr(choice.shape, k) for k in data if k != "size"})
    return cfg.model_copy(update={"model": chosen}), choice


def explain_shape(shape: LlamaConfig, train: Any, cache_dir: Path | None) -> SizeChoice:
    """What pretrain logs for a shape auto chose: its measured speed (cached when the run chose it) and
    what the budget buys it."""
    rate = _rates([shape], train, cache_dir)[0]
    return describe(shape, rate, train_budget(train, shape.block_size), note="; chosen by model.size=auto")


def planned_vocab_size(cfg: Any) -> int:
    """The vocabulary the model will have: a given tokenizer's, else the one to be trained."""
    if cfg.tokenizer.path:
        try:
            from tokenizers import Tokenizer

            return Tokenizer.from_file(str(Path(cfg.tokenizer.path).expanduser())).get_vocab_size()
        except Exception:  # an unreadable tokenizer fails in tokenize, with its own message
            pass
    return cfg.tokenizer.vocab_size
