"""Running the training engine for a stage, in this process or under torchrun (DDP over gloo).

A stage makes a TrainingSpec (paths, its settings, the MLflow run, its hooks) and calls ``execute``.
With ``train.nproc_per_node * train.nnodes > 1`` that writes the spec as launch.json and launches
``cpuforge.tasks.engine.distributed`` under torchrun, and every process calls ``run_training(spec)``;
otherwise this process does. ``spec.kind`` says what is trained: ``pretrain`` (a fresh or given
model, LM loss) or ``recover`` (the pruned student distilled from the teacher). Rank 0 logs,
checkpoints and writes the outputs, and the TrainingResult (result.json).

The engine imports nothing of the pipeline (tests/test_layout.py). What the pipeline plugs in is
given: the live progress as a callback to ``execute``, and, because a spec crosses into torchrun's
workers and other machines, the per-step metric sink and the training slot as TrainingHooks, named
by dotted path in the spec.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel

from cpuforge.models.checkpoint import load_model, read_config, save_model
from cpuforge.models.config import LlamaConfig
from cpuforge.models.fileio import atomic_write_text
from cpuforge.models.hf_format import write_tokenizer
from cpuforge.models.llama import Llama, flops_per_token, zero_residual_projections
from cpuforge.tasks.config.settings import RecoverConfig, TrainConfig
from cpuforge.tasks.engine import sharding
from cpuforge.tasks.engine.compile_choice import budget_seconds, choose_compile, use_inductor_cache
from cpuforge.tasks.engine.data import open_shards, token_byte_lengths, val_batches
from cpuforge.tasks.engine.hardware import available_cores, matmul_peak
from cpuforge.tasks.engine.losses import distillation_loss, lm_loss
from cpuforge.tasks.engine.processes import stop_process_group
from cpuforge.tasks.engine.progress import ProgressFile, budget_bar
from cpuforge.tasks.engine.rendezvous import torchrun_command
from cpuforge.tasks.engine.step_timing import choose_precision
from cpuforge.tasks.engine.trainer import RunFacts, TrainingResult, train

log = logging.getLogger("cpuforge.training")

PROGRESS_FILE = "progress.json"  # rank 0's latest progress, which the stage's process shows in Prefect

OnProgress = Callable[[float, dict[str, Any]], None]  # on_progress(fraction, headline), in the launching process


def dotted(obj: Any) -> str:
    """``module:name`` of a module-level function or class, checked to name it back (resolve)."""
    path = f"{obj.__module__}:{obj.__qualname__}"
    try:
        found = resolve(path)
    except (ImportError, AttributeError):
        found = None
    if found is not obj:  # a lambda, a nested function, a name rebound since
        raise ValueError(f"{obj!r} is not importable as {path}")
    return path


def resolve(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class TrainingHooks(BaseModel):
    """What the pipeline plugs into a training where the engine cannot be handed an object: in torchrun's
    workers and on machines that join (launch.json). Each is a dotted path ("module:name", dotted()),
    resolved where it is used; empty: not used (tests, benchmarks)."""

    # rank 0's per-step metrics: metrics(tracking_uri, run_id) -> log(metrics, step), with .flush()
    metrics: str = ""
    # this machine's training slots: slot(what) -> a context manager held while deciding and training
    slot: str = ""

    @classmethod
    def of(cls, metrics: Callable[..., Any] | None = None, slot: Callable[[str], Any] | None = None) -> TrainingHooks:
        return cls(metrics=dotted(metrics) if metrics else "", slot=dotted(slot) if slot else "")

    def training_slot(self, what: str) -> contextlib.AbstractContextManager:
        return resolve(self.slot)(what) if self.slot else contextlib.nullcontext()


class TrainingSpec(BaseModel):
    """One training, as JSON: it crosses into torchrun workers and to other machines (launch.json)."""

    kind: Literal["pretrain", "recover"]
    train: TrainConfig
    recover: RecoverConfig | None = None  # recover: its budget and distillation settings
    model: LlamaConfig | None = None  # pretrain: the shape to build (recover reads it from student_dir)
    tokenize_dir: str
    out_dir: str
    threads: int
    dtype: str = "float32"
    precision: dict[str, Any] = {}  # the precision decision: chosen dtype, why, tokens/s measured per dtype
    compile: dict[str, Any] = {}  # the torch.compile decision: on or off, why, tokens/s measured each way
    peak_flops: float = 0.0  # measured matmul FLOP/s per process in `dtype`: MFU's denominator
    flops_per_token: float = 0.0
    tracking_uri: str = ""
    run_id: str | None = None  # the stage's MLflow run, for per-step metrics
    init_dir: str | None = None  # pretrain: start from these weights
    student_dir: str | None = None
    teacher_dir: str | None = None
    rdzv_id: str = ""  # names the rendezvous of a multi-process run
    cache_dir: str = ""  # the workdir's cache: torch.compile keeps its compiled graphs there (train.compile)
    hooks: TrainingHooks = TrainingHooks()  # the pipeline's metric sink and training slot


def threads_per_process(train_cfg: TrainConfig) -> int:
    return train_cfg.threads or max(1, available_cores() // train_cfg.nproc_per_node)


def recover_train_config(t: TrainConfig, r: RecoverConfig) -> TrainConfig:
    """The train section recovery trains under: pretraining's, with recovery's budget, optimizer and learning
    rates, and cosine decay whatever pretraining used: train.optimizer/muon_lr/lr_schedule were tuned for
    training from scratch, not for distilling into pruned weights (docs/training.md, "Recovery's optimizer")."""
    return t.model_copy(update={
        "lr": r.lr, "min_lr": r.lr / 10, "optimizer": r.optimizer_in_use(t), "muon_lr": r.muon_lr,
        "lr_schedule": "cosine", "warmup_steps": min(t.warmup_steps, 10),
        "max_tokens": r.max_tokens, "max_steps": r.max_steps, "max_minutes": r.max_minutes,
        "seed": t.seed + 1,  # a data stream of its own, not a replay of pretraining's first steps
    })


def world_size(train_cfg: TrainConfig) -> int:
    return train_cfg.nproc_per_node * train_cfg.nnodes


def training_flops_per_token(model_cfg: LlamaConfig, teacher_cfg: LlamaConfig | None = None) -> float:
    """FLOPs a training step spends per token: the model's forward and backward, plus the teacher's
    forward pass when distilling (MFU counts all the work the step does)."""
    flops = flops_per_token(model_cfg)
    return flops + flops_per_token(teacher_cfg, backward=False) if teacher_cfg is not None else flops


def _shapes(kind: str, model: LlamaConfig | None, student_dir: str | Path | None = None,
            teacher_dir: str | Path | None = None) -> tuple[LlamaConfig, LlamaConfig | None]:
    """(the trained model's config, the teacher's or None) of a training."""
    if kind == "recover":
        return read_config(Path(student_dir)), read_config(Path(teacher_dir))
    return model, None


def step_optimizer(kind: str, train_cfg: TrainConfig, recover: RecoverConfig | None = None) -> str:
    """The optimizer a training's step runs: recover.optimizer in recovery, train.optimizer in pretraining."""
    if kind == "recover":
        return (recover or RecoverConfig()).optimizer_in_use(train_cfg)
    return train_cfg.optimizer_in_use()


def training_spec(kind: Literal["pretrain", "recover"], train_cfg: TrainConfig, tokenize_dir: Path | str,
                  out_dir: Path, run_id: str | None, cache_dir: Path, tracking_uri: str = "", *,
                  model: LlamaConfig | None = None, recover: RecoverConfig | None = None,
                  hooks: TrainingHooks = TrainingHooks(), **model_dirs: Path) -> TrainingSpec:
    """The spec of one training. The precision is decided here, once (measured A/B under
    precision=auto, within a share of a wall-clock budget), and MFU's denominator is the matmul peak of that precision. Whether to
    torch.compile is decided by ``execute``, under the training slot (decide_compile)."""
    threads = threads_per_process(train_cfg)
    model_cfg, teacher_cfg = _shapes(kind, model, model_dirs.get("student_dir"), model_dirs.get("teacher_dir"))
    optimizer = step_optimizer(kind, train_cfg, recover)
    limits = recover if kind == "recover" and recover is not None else train_cfg
    budget_s = budget_seconds(limits.max_minutes, limits.max_steps, limits.max_tokens,
                              train_cfg.batch_size * train_cfg.grad_accum * model_cfg.block_size, None)
    precision = choose_precision(train_cfg.precision, model_cfg, train_cfg.batch_size, threads, cache_dir, teacher_cfg,
                                 optimizer, train_cfg.activation_checkpointing, budget_s)
    dtype = precision["dtype"]
    return TrainingSpec(
        kind=kind, train=train_cfg, recover=recover, model=model if kind == "pretrain" else None,
        tokenize_dir=str(tokenize_dir), out_dir=str(out_dir), threads=threads, dtype=dtype, precision=precision,
        peak_flops=matmul_peak(threads, cache_dir, getattr(torch, dtype)),
        flops_per_token=training_flops_per_token(model_cfg, teacher_cfg), tracking_uri=tracking_uri, run_id=run_id,
        cache_dir=str(cache_dir), hooks=hooks, **{name: str(path) for name, path in model_dirs.items()},
    )


def decide_compile(spec: TrainingSpec) -> TrainingSpec:
    """The spec with its torch.compile decision (compile_choice.choose_compile): train.compile as set, or
    under 'auto' a bounded probe of this step, whose seconds the wall-clock budget pays (budget_left).
    The step's rate from the precision A/B tells how long a step or token budget will take."""
    t = spec.train
    model_cfg, teacher_cfg = _shapes(spec.kind, spec.model, spec.student_dir, spec.teacher_dir)
    limits = spec.recover if spec.kind == "recover" and spec.recover is not None else t
    budget = budget_seconds(limits.max_minutes, limits.max_steps, limits.max_tokens,
                            t.batch_size * t.grad_accum * model_cfg.block_size,
                            spec.precision.get("bf16_tok_s" if spec.dtype == "bfloat16" else "fp32_tok_s"))
    optimizer = step_optimizer(spec.kind, t, spec.recover)
    decision = choose_compile(t.compile, model_cfg, t.batch_size, spec.threads, spec.dtype, Path(spec.cache_dir),
                              budget, teacher_cfg, optimizer, t.activation_checkpointing, world_size(t))
    return spec.model_copy(update={"compile": decision})


def precision_params(spec: TrainingSpec) -> dict[str, Any]:
    """What a training stage logs to MLflow about its precision: the choice, why, and its peak."""
    return {"precision": spec.dtype, "precision_choice": spec.precision.get("reason", ""),
            "matmul_peak_gflops": round(spec.peak_flops / 1e9, 1), "matmul_peak_dtype": spec.dtype}


def precision_metrics(spec: TrainingSpec) -> dict[str, float]:
    """The A/B's figures (tokens/s of a training step per precision, at ab_batch sequences a step), where they
    were measured, and the seconds this run's A/B took."""
    figures = {f"precision_{name}_tok_s": spec.precision[f"{name}_tok_s"] for name in ("fp32", "bf16")
               if spec.precision.get(f"{name}_tok_s") is not None}
    return figures | {f"precision_{name}": spec.precision[name] for name in ("ab_batch", "probe_s")
                      if spec.precision.get(name)}


def compile_params(decision: dict[str, Any]) -> dict[str, Any]:
    """What a training stage logs to MLflow about torch.compile (TrainingResult.compile): whether the step
    was compiled, and why."""
    return {"compiled": bool(decision.get("compile")), "compile_choice": decision.get("reason", "")}


def compile_metrics(decision: dict[str, Any]) -> dict[str, float]:
    """The figures the compile decision rests on (tokens/s eager and compiled, the first compile's seconds;
    measured once per machine and shape, then cached), and the seconds this run's probe took, where it ran."""
    figures = {f"compile_{name}": decision[name] for name in ("eager_tok_s", "compiled_tok_s", "compile_s")
               if decision.get(name) is not None}
    return figures | ({"compile_probe_s": decision["probe_s"]} if decision.get("probe_s") else {})


def budget_left(s: TrainConfig, spent_s: float) -> TrainConfig:
    """The settings with a wall-clock budget less what deciding how to train already spent (the compile probe):
    the budget is the training's wall-clock, finding out included."""
    if not s.max_minutes or spent_s <= 0:
        return s
    return s.model_copy(update={"max_minutes": max(s.max_minutes - spent_s / 60, 1 / 60)})


def execute(spec: TrainingSpec, on_progress: OnProgress | None = None) -> TrainingResult:
    """Train as the spec says, here or under torchrun; returns rank 0's result. Holds one of
    this machine's training slots meanwhile (spec.hooks.slot), waiting for one if they are all taken.
    ``on_progress(fraction, headline)`` (the stage's live progress) follows what rank 0 writes to
    progress.json."""
    out_dir = Path(spec.out_dir)
    progress = out_dir / PROGRESS_FILE
    progress.unlink(missing_ok=True)  # an interrupted attempt's: this one reports afresh
    with spec.hooks.training_slot(f"{spec.kind} {out_dir.name}"), follow_progress_file(progress, on_progress):
        if not spec.compile:  # under the slot: a probe timed beside another training would be slow, and cached
            spec = decide_compile(spec)
        if world_size(spec.train) > 1:
            # The stage's folder (stage name and key) names the rendezvous: the same on every machine,
            # and another stage or config never joins it by mistake.
            spec = spec.model_copy(update={"rdzv_id": out_dir.name.removesuffix(".partial")})
            spec_path = out_dir / "launch.json"
            atomic_write_text(spec_path, spec.model_dump_json(indent=2))
            launch_torchrun(spec.train, spec_path, spec.rdzv_id)
            return TrainingResult.model_validate_json((out_dir / "result.json").read_text())
        result = run_training(spec)
        assert result is not None  # this process is rank 0
        return result


@contextlib.contextmanager
def follow_progress_file(path: Path, on_progress: OnProgress | None, every_s: float = 1.0) -> Iterator[None]:
    """Forward what a training process writes to ``path`` (tasks/engine/progress.ProgressFile) to
    ``on_progress`` from a thread, until the block ends. The training may run in this process or in
    torchrun's workers, which have no context of the stage's own (Prefect's): the parent reports for them."""
    if on_progress is None:
        yield
        return
    stop = threading.Event()
    seen = [0.0]

    def forward() -> None:
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):  # not written yet (or replaced this instant): next time
            return
        if state.get("written", 0) > seen[0]:
            seen[0] = state["written"]
            on_progress(state["fraction"], state.get("headline") or {})

    def loop() -> None:
        while not stop.wait(every_s):
            forward()

    # The thread runs in a copy of this context: the callback's settings (Prefect's API URL) live in context variables.
    thread = threading.Thread(target=contextvars.copy_context().run, args=(loop,), name="cpuforge-live", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        forward()  # the last state the training wrote


def _build(spec: TrainingSpec) -> tuple[torch.nn.Module, Any, TrainConfig, RunFacts]:
    """(model to train, loss function, its train settings, the run's facts) for the spec's kind. Recovery
    trains under recover_train_config; either way the wall-clock budget is less the compile probe's seconds."""
    facts = RunFacts(dtype=getattr(torch, spec.dtype), peak_flops=spec.peak_flops)
    probe_s = spec.compile.get("probe_s", 0)
    if spec.kind == "recover":
        assert spec.recover is not None and spec.student_dir and spec.teacher_dir
        student, teacher = load_model(Path(spec.student_dir)), load_model(Path(spec.teacher_dir))
        r = spec.recover
        return student, distillation_loss(teacher, r.temperature, r.kd_weight, r.lm_weight), \
            budget_left(recover_train_config(spec.train, r), probe_s), \
            replace(facts, flops_per_token=training_flops_per_token(student.cfg, teacher.cfg))
    assert spec.model is not None
    # Continued pretraining starts from given weights (a checkpoint found later still takes precedence).
    if spec.init_dir:
        model = load_model(Path(spec.init_dir), expect=spec.model, max_context=spec.model.block_size)
    else:
        model = Llama(spec.model)
        if spec.train.zero_init_residual:
            zero_residual_projections(model)
    return model, lm_loss, budget_left(spec.train, probe_s), facts


def run_training(spec: TrainingSpec | dict[str, Any]) -> TrainingResult | None:
    """Build the model and train it. Runs in this process, or in each torchrun worker (rank 0
    returns the result, the others None)."""
    import torch.distributed as dist

    spec = TrainingSpec.model_validate(spec)
    t = spec.train
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.set_num_threads(spec.threads)
    torch.manual_seed(t.seed)
    model, loss_fn, train_cfg, facts = _build(spec)
    block = model.cfg.block_size
    shards = open_shards(Path(spec.tokenize_dir), block)
    model.activation_checkpointing = t.activation_checkpointing
    if spec.compile.get("compile", t.compile is True):
        if spec.cache_dir:  # inductor's FX graph and autograd caches: a later run (or auto's probe) compiled already
            use_inductor_cache(spec.cache_dir)
        model.compile_forward()
    out_dir = Path(spec.out_dir)
    byte_lengths = token_byte_lengths(shards.tokenizer_path)
    val = val_batches(shards.val, t.eval_batches, t.batch_size, block)
    # rank 0 sends each step's metrics to the stage's run (MLflow: tasks/infra/tracking.MetricLogger)
    logger = resolve(spec.hooks.metrics)(spec.tracking_uri, spec.run_id) \
        if rank == 0 and spec.run_id and spec.hooks.metrics else None

    quiet = contextlib.nullcontext(lambda fraction, status: None)  # only rank 0 draws progress
    progress_file = ProgressFile(out_dir / PROGRESS_FILE) if rank == 0 else None

    def log_metrics(metrics: dict[str, float], step: int) -> None:
        if logger:
            logger(metrics, step)
        progress_file.metrics(metrics, step)

    with budget_bar(spec.kind) if rank == 0 else quiet as update:
        def on_progress(fraction: float, status: str) -> None:
            update(fraction, status)
            progress_file.progress(fraction, status, final=fraction >= 1.0)

        result = train(model, shards.train, val, byte_lengths, train_cfg, out_dir / "checkpoints", facts,
                       loss_fn=loss_fn, log_metrics=log_metrics if progress_file else None,
                       on_progress=on_progress if progress_file else update)
    if logger:
        logger.flush()
    weights = sharding.full_weights(model)  # every rank takes part when the model is sharded
    if rank != 0:
        return None
    save_model(model, out_dir / "model", extra={"dtype": spec.dtype}, weights=weights)
    write_tokenizer(out_dir / "model", shards.tokenizer_path, shards.meta["eod_token"], shards.eod_id)
    atomic_write_text(out_dir / "history.jsonl", "".join(json.dumps(h) + "\n" for h in result.history))
    result = result.model_copy(update={"compile": spec.compile})
    atomic_write_text(out_dir / "result.json", result.model_dump_json(indent=2))  # the history is not in it
    return result


def launch_torchrun(train_cfg: TrainConfig, spec_path: Path, rdzv_id: str) -> None:
    """Run cpuforge.tasks.engine.distributed under torchrun; every process trains, rank 0 writes the outputs."""
    cmd, network = torchrun_command(train_cfg, spec_path, rdzv_id)
    env = {**network, **os.environ, "OMP_NUM_THREADS": str(threads_per_process(train_cfg))}  # a GLOO_SOCKET_IFNAME set wins
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


def join(spec_path: Path) -> None:
    """Another machine's share of a multi-machine run: the same torchrun, from the stage's launch.json,
    holding one of this machine's training slots (the spec's hook) meanwhile."""
    spec = TrainingSpec.model_validate_json(spec_path.read_text())
    with spec.hooks.training_slot(f"{spec.kind} {spec.rdzv_id} (joined)"):
        launch_torchrun(spec.train, spec_path, spec.rdzv_id)


if __name__ == "__main__":  # python -m cpuforge.tasks.engine.training_run /shared/work/stages/<stage>-<key>.partial/launch.json
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    join(Path(sys.argv[1]))
