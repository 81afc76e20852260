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
