"""Console progress bars with ETA (only on a terminal: CI logs get the stage's log lines instead)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


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
