"""Console progress bars with ETA (only on a terminal: CI logs get the stage's log lines instead), and
the progress file a training writes for the Prefect UI."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from cpuforge.models.fileio import atomic_write_json


@contextlib.contextmanager
def progress_bar(description: str, total: float) -> Iterator[Callable[[float], None]]:
    """Yield ``advance(n)``; draws a bar with ETA on an interactive terminal, nothing otherwise."""
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        disable=not sys.stderr.isatty(), transient=False,
    )
    with progress:
        task_id = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task_id, n)


@contextlib.contextmanager
def budget_bar(description: str) -> Iterator[Callable[[float, str], None]]:
    """Yield ``update(fraction_done, status)`` for a run whose end is a budget, not a count."""
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
        TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
        disable=not sys.stderr.isatty(), transient=False,
    )
    with progress:
        task_id = progress.add_task(description, total=1.0, status="")
        yield lambda fraction, status: progress.update(task_id, completed=fraction, status=status)


class ProgressFile:
    """A training's latest progress as a small JSON file (rank 0 writes it, at most every ``every_s``),
    for whoever reports it elsewhere: the stage's parent process forwards it to the Prefect UI
    (tasks/infra/live.py), including from torchrun workers that have no Prefect context."""

    def __init__(self, path: Path, every_s: float = 1.0) -> None:
        self.path, self.every_s = path, every_s
        self.last = float("-inf")
        self.latest: dict[str, float] = {}

    def metrics(self, metrics: dict[str, float], step: int) -> None:
        """Called with each step's metrics (the trainer's log_metrics), before that step's progress."""
        self.latest.update(metrics, step=step)

    def progress(self, fraction: float, status: str = "", final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < self.every_s:
            return
        self.last = now
        m = self.latest
        headline: dict[str, float | int | str] = {"step": int(m.get("step", 0))}
        for name, key in (("tokens/s", "train/tokens_per_s"), ("loss", "train/loss"),
                          ("last val bits per byte", "val/bpb"), ("MFU %", "train/mfu"), ("tokens", "train/tokens")):
            if key in m and math.isfinite(m[key]):
                headline[name] = 100 * m[key] if key == "train/mfu" else m[key]
        if "tokens" in headline:
            headline["tokens"] = int(headline["tokens"])
        elapsed = m.get("train/elapsed", 0.0)  # includes the time before a resume, as the fraction does
        if 0 < fraction < 1 and elapsed > 0:
            headline["time left"] = f"{elapsed * (1 - fraction) / fraction / 60:.1f} min"
        elif fraction >= 1:
            headline["time left"] = "0 min"
        atomic_write_json(self.path, {"fraction": fraction, "headline": headline, "status": status,
                                      "written": time.time()})
