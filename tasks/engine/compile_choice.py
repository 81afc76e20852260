"""train.compile=auto: torch.compile the model only where it is measured to pay within the run's budget.

What compiling is worth differs by CPU far more than by model: on an AMX Xeon the demo's bf16 step
measured 1.31-1.53x faster after a 26-41 s compile (3 s once inductor's cache holds the graphs); on
an AVX2-only machine the same step gained 1.07x for 169 s of compiling. So 'auto' measures it, with a
bounded cost: a child process compiles and times the run's own training step (the same loss,
optimizer, precision and batch layout) and is stopped if it has not finished within PROBE_SHARE of
the training budget (at most MAX_PROBE_S), which then loses that time and nothing else. The child writes
its graphs to the work folder's inductor cache, so the training that follows compiles in seconds;
the decision is cached per (CPU, threads, model shape, batch, step, precision, torch version), so a
later run on this machine decides for free.

    python -m cpuforge.tasks.engine.compile_choice ARGS.json RESULT.json   # the child
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from cpuforge.tasks.engine.processes import stop_process_group
from cpuforge.tasks.engine.step_timing import AB_ROUNDS, step_key, training_step_timer

log = logging.getLogger("cpuforge.compile")

COMPILE_MIN_GAIN = 1.10  # compiled steps must be at least this much faster (a warm compile still costs seconds)
PROBE_SHARE = 0.2  # of the training budget, at most, spent finding out: what a 1.25x gain repays
MIN_PROBE_S = 30.0  # a cold compile of even a small model takes about this long: shorter budgets are not probed
MAX_PROBE_S = 300.0
CACHE_FILE = "compile.json"


def inductor_cache_dir(cache_dir: Path | str) -> Path:
    """Where torch.compile keeps its compiled graphs (FX graph and autograd caches) in the work folder."""
    return Path(cache_dir) / "inductor"


def use_inductor_cache(cache_dir: Path | str) -> None:
    """Point this process's torch.compile at the work folder's cache. Set, not defaulted: inductor writes its
    own default (a folder under /tmp) into TORCHINDUCTOR_CACHE_DIR the first time it looks the variable up."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir(cache_dir))


def budget_seconds(max_minutes: float | None, max_steps: int | None, max_tokens: int | None,
                   tokens_per_step: int, tok_s: float | None) -> float | None:
    """The training's wall-clock, as far as it is known before it starts: the clock budget, or the
    step/token budget at a measured eager rate, whichever ends first; None when neither can be told."""
    limits = [max_minutes * 60] if max_minutes else []
    tokens = [n for n in (max_steps and max_steps * tokens_per_step, max_tokens) if n]
    if tokens:
        if not tok_s:
            return None  # a step or token budget of unknown duration may be seconds long
        limits.append(min(tokens) / tok_s)
    return min(limits) if limits else None


def _eager(reason: str, **figures: Any) -> dict[str, Any]:
    return {"compile": False, "reason": reason, "eager_tok_s": None, "compiled_tok_s": None, "compile_s": None,
            "probe_s": 0.0, **figures}


def _unprobed(reason: str) -> dict[str, Any]:
    log.info("compile off: %s", reason)
    return _eager(reason)


def choose_compile(requested: bool | str, model_cfg, batch: int, threads: int, dtype: str, cache_dir: Path,
                   budget_s: float | None, teacher_cfg=None, optimizer: str = "adamw",
                   activation_checkpointing: bool = False, world: int = 1) -> dict[str, Any]:
    """Whether to torch.compile, and why: {"compile", "reason", "eager_tok_s", "compiled_tok_s",
    "compile_s", "probe_s"} (figures None where not measured; probe_s: wall-clock this call spent,
    which the caller takes from the training budget)."""
    if requested is True or requested is False:
        return _eager(f"train.compile={str(requested).lower()}") | {"compile": requested}
    if world > 1:
        return _unprobed("not measured under torchrun: compile=auto stays eager with several processes "
                         "(train.compile=true compiles in each)")
    if budget_s is None:
        return _unprobed("the budget's duration is not known before training (a step or token budget with no "
                         "measured rate): not probed")
    allowance = min(MAX_PROBE_S, PROBE_SHARE * budget_s)
    if allowance < MIN_PROBE_S:
        return _unprobed(f"a {budget_s:.0f} s budget cannot repay a compile (probing would take up to "
                         f"{MIN_PROBE_S:.0f} s of it): not probed")
    key = f"{step_key(model_cfg, batch, threads, teacher_cfg, optimizer, activation_checkpointing)}|{dtype}"
    cache = cache_dir / CACHE_FILE
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    cached = known.get(key)
    # A probe that ran out of time is tried again only with clearly more time to spend.
    if cached is not None and not (cached.get("timed_out_s") and allowance > 1.5 * cached["timed_out_s"]):
        log.info("compile %s (cached: %s)", "on" if cached["compile"] else "off", cached["reason"])
        return {**cached, "probe_s": 0.0}
    log.info("compile=auto: compiling this training step in a child process and timing it against eager "
             "(at most %.0f s of the %.0f s budget, once per machine and shape)", allowance, budget_s)
    started = time.perf_counter()
    decision, lasting = _probe(model_cfg, batch, threads, dtype, cache_dir, allowance, teacher_cfg, optimizer,
                               activation_checkpointing)
    decision["probe_s"] = round(time.perf_counter() - started, 1)
    log.info("compile %s: %s", "on" if decision["compile"] else "off", decision["reason"])
    if lasting:  # a measurement, a timeout or a compiler that does not work; not a crash that may not recur
        from cpuforge.models.fileio import atomic_write_json

        atomic_write_json(cache, {**known, key: {k: v for k, v in decision.items() if k != "probe_s"}})
    return decision


COMPILER_ERRORS = re.compile(r"InvalidCxxCompiler|CppCompileError|InductorError|BackendCompilerFailed")


def _probe(model_cfg, batch: int, threads: int, dtype: str, cache_dir: Path, allowance: float, teacher_cfg,
           optimizer: str, activation_checkpointing: bool) -> tuple[dict[str, Any], bool]:
    """(the decision, whether it holds for later runs) from the child, stopped after ``allowance`` seconds."""
    with tempfile.TemporaryDirectory(prefix="cpuforge-compile-") as tmp:
        args, result = Path(tmp) / "args.json", Path(tmp) / "result.json"
        args.write_text(json.dumps({
            "model": model_cfg.to_dict(), "teacher": teacher_cfg.to_dict() if teacher_cfg is not None else None,
            "batch": batch, "threads": threads, "dtype": dtype, "optimizer": optimizer,
            "activation_checkpointing": activation_checkpointing}))
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache_dir(cache_dir)),
               "OMP_NUM_THREADS": str(threads)}
        # A session of its own: stopped, the child and inductor's compile workers all stop.
        proc = subprocess.Popen([sys.executable, "-m", __name__, str(args), str(result)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=allowance)
        except subprocess.TimeoutExpired:
            stderr = _stop(proc)
            if not result.is_file():
                return _eager(f"compiling did not finish within {allowance:.0f} s ({PROBE_SHARE:.0%} of the budget, "
                              f"at most {MAX_PROBE_S:.0f} s): stayed eager", timed_out_s=round(allowance, 1)), True
        except BaseException:  # interrupted or cancelled: the child must not compile on, unseen, on every core
            _stop(proc)
            raise
        if not result.is_file():
            error = _error_line(stderr, proc.returncode)
            lasting = bool(COMPILER_ERRORS.search(error))
            return _eager(f"torch.compile failed on this machine ({error}): stayed eager"), lasting
        figures = json.loads(result.read_text())
    gain = figures["compiled_tok_s"] / figures["eager_tok_s"]
    return {"compile": compile_pays(figures["eager_tok_s"], figures["compiled_tok_s"]), **figures, "probe_s": 0.0,
            "reason": f"measured training step: compiled {figures['compiled_tok_s']:.0f} tok/s vs eager "
                      f"{figures['eager_tok_s']:.0f} tok/s ({gain:.2f}x; compile needs >= {COMPILE_MIN_GAIN:g}x), "
                      f"first compile {figures['compile_s']:.0f} s"}, True


def compile_pays(eager_tok_s: float, compiled_tok_s: float) -> bool:
    """auto's rule: compile where the compiled step is at least COMPILE_MIN_GAIN x the eager one."""
    return compiled_tok_s >= COMPILE_MIN_GAIN * eager_tok_s


def _stop(proc: subprocess.Popen) -> str:
    """Stop the child's process group; what it had written to stderr."""
    stop_process_group(proc, grace_s=5.0)
    try:
        return proc.communicate(timeout=5.0)[1] or ""
    except subprocess.TimeoutExpired:  # something of the group still holds the pipe
        return ""


def _error_line(stderr: str, returncode: int) -> str:
    """The exception a failed child died of (its traceback's last "SomeError: ..." line; torch adds advice after it)."""
    lines = [line for line in (stderr or "").splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception)\b.*:", line)]
    return ((errors or lines)[-1] if lines else f"exit code {returncode}")[:300]


def measure(model: dict, teacher: dict | None, batch: int, threads: int, dtype: str, optimizer: str,
            activation_checkpointing: bool) -> dict[str, float]:
    """The child's work: compile the step, then time eager and compiled steps in alternation; tokens/s of
    each and the first compile's seconds. (Evaluation passes are not compiled: trainer.evaluate runs eager.)"""
    from cpuforge.models.config import LlamaConfig

    torch.set_num_threads(threads)
    model_cfg = LlamaConfig.from_dict(model)
    teacher_cfg = LlamaConfig.from_dict(teacher) if teacher else None
    step_dtype = getattr(torch, dtype)
    eager, compiled = (training_step_timer(model_cfg, batch, optimizer, teacher_cfg, activation_checkpointing,
                                           compiled=c) for c in (False, True))
    compile_s = compiled(step_dtype)
    eager(step_dtype)  # warm-up
    best = {"eager": float("inf"), "compiled": float("inf")}
    for _ in range(AB_ROUNDS + 1):
        for name, step in (("eager", eager), ("compiled", compiled)):
            best[name] = min(best[name], step(step_dtype))
    tokens = batch * model_cfg.block_size
    return {"eager_tok_s": round(tokens / best["eager"], 1), "compiled_tok_s": round(tokens / best["compiled"], 1),
            "compile_s": round(compile_s, 1)}


if __name__ == "__main__":
    from cpuforge.models.fileio import atomic_write_json

    atomic_write_json(Path(sys.argv[2]), measure(**json.loads(Path(sys.argv[1]).read_text())))
