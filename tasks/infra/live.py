"""A running stage's progress in the Prefect UI, while it runs: a progress artifact (share of its
budget or of its work done) and the stage's markdown artifact showing the live headline (tokens/s,
last val bits per byte, time left). Both are updated in place, at most every few seconds; when the
stage finishes, finish_stage replaces the live headline with the final numbers (same artifact).
The same progress goes to the run's log (the terminal, and the flow run's logs in the UI) as one line
every LOG_EVERY_S: share done, elapsed, time left, the headline.

Outside a Prefect task run (a unit test, a plain function call) reporting does nothing. A failure to
reach the Prefect API is logged once and never fails the stage: progress is a view, not the work.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from uuid import UUID

log = logging.getLogger("cpuforge.live")

# Seconds between two updates of the progress artifact and of the markdown headline. Each update is
# one request to the Prefect API; a 6-hour training needs no more than this. Tests set them to 0.
PROGRESS_EVERY_S = float(os.environ.get("CPUFORGE_LIVE_PROGRESS_S", "2"))
MARKDOWN_EVERY_S = float(os.environ.get("CPUFORGE_LIVE_MARKDOWN_S", "5"))
# Seconds between two progress lines in the log: a stage of an hour says where it is 120 times.
LOG_EVERY_S = float(os.environ.get("CPUFORGE_PROGRESS_LOG_S", "30"))

Report = Callable[..., None]  # report(fraction, headline=None)

# The live markdown artifact of each (task run, stage), so finish_stage can replace it in place.
_markdown_ids: dict[tuple[str, str], UUID] = {}


def artifact_key(stage: str) -> str:
    """The stage's markdown artifact key (lowercase letters, digits and dashes, as Prefect requires)."""
    return "".join(c if c.isalnum() or c == "-" else "-" for c in f"cpuforge-{stage}".lower())


def format_seconds(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def _time_left(fraction: float, elapsed_s: float, headline: dict[str, Any]) -> str:
    """The stage's own estimate (a training's), else elapsed time scaled by the share still to do."""
    return headline.get("time left") or (format_seconds(elapsed_s * (1 - fraction) / fraction) if fraction > 0 else "?")


def headline_markdown(stage: str, fraction: float, elapsed_s: float, headline: dict[str, Any]) -> str:
    left = _time_left(fraction, elapsed_s, headline)
    lines = [f"### {stage} — running, {100 * fraction:.0f}%", "",
             f"- elapsed: {format_seconds(elapsed_s)}, time left: {left}"]
    lines += [f"- {name}: {_fmt(value)}" for name, value in headline.items() if name != "time left"]
    lines += ["", "_updated while the stage runs; the final numbers replace this when it ends_"]
    return "\n".join(lines)


def progress_line(stage: str, fraction: float, elapsed_s: float, headline: dict[str, Any]) -> str:
    """One log line: `quantize 45%, 2m10s elapsed, about 2m39s left (phase: timing round 2 ...)`."""
    left = _time_left(fraction, elapsed_s, headline)
    details = ", ".join(f"{name}: {_fmt(value)}" for name, value in headline.items() if name != "time left")
    return (f"{stage} {100 * fraction:.0f}%, {format_seconds(elapsed_s)} elapsed, about {left} left"
            + (f" ({details})" if details else ""))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.4g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


class LiveStage:
    """Reports one stage run's progress to Prefect; call it as ``report(fraction, headline)``."""

    def __init__(self, stage: str, task_run_id: UUID, flow_run_id: UUID | None) -> None:
        self.stage, self.task_run_id, self.flow_run_id = stage, task_run_id, flow_run_id
        self.started = time.monotonic()
        self.progress_id: UUID | None = None
        self.markdown_id: UUID | None = None
        self.last_progress = self.last_markdown = float("-inf")
        self.last_log = time.monotonic()  # the first line after LOG_EVERY_S: a short stage logs none
        self.fraction = 0.0
        self.headline: dict[str, Any] = {}
        self.broken = False
        self.lock = threading.Lock()  # the training watcher reports from a thread of its own

    def __call__(self, fraction: float, headline: dict[str, Any] | None = None, force: bool = False) -> None:
        with self.lock:
            self.fraction = min(1.0, max(self.fraction, fraction))  # never shown going backwards
            if headline:
                self.headline = headline
            now = time.monotonic()
            if now - self.last_log >= LOG_EVERY_S and self.fraction < 1:
                log.info("%s", progress_line(self.stage, self.fraction, now - self.started, self.headline))
                self.last_log = now
            if self.broken:
                return
            try:
                if force or now - self.last_progress >= PROGRESS_EVERY_S:
                    self._progress()
                    self.last_progress = now
                if self.headline and (force or now - self.last_markdown >= MARKDOWN_EVERY_S):
                    self._markdown(headline_markdown(self.stage, self.fraction, now - self.started, self.headline))
                    self.last_markdown = now
            except Exception as exc:  # the Prefect API went away: keep training, say so once
                self.broken = True
                log.warning("%s: live progress in Prefect stopped (%s: %s)", self.stage, type(exc).__name__, exc)

    def _request(self, **fields: Any):
        from prefect.client.schemas.actions import ArtifactCreate

        return ArtifactCreate(task_run_id=self.task_run_id, flow_run_id=self.flow_run_id, **fields)

    def _progress(self) -> None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import ArtifactUpdate

        value = round(100 * self.fraction, 1)
        with get_client(sync_client=True) as client:
            if self.progress_id is None:
                self.progress_id = client.create_artifact(self._request(
                    type="progress", key=artifact_key(f"{self.stage}-progress"), data=value,
                    description=f"cpuforge {self.stage}: share of its budget or work done")).id
            else:
                client.update_artifact(self.progress_id, ArtifactUpdate(data=value))

    def _markdown(self, markdown: str) -> None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import ArtifactUpdate

        with get_client(sync_client=True) as client:
            if self.markdown_id is None:
                self.markdown_id = client.create_artifact(self._request(
                    type="markdown", key=artifact_key(self.stage), data=markdown,
                    description=f"cpuforge {self.stage}: live headline (final numbers when it ends)")).id
                _markdown_ids[(str(self.task_run_id), self.stage)] = self.markdown_id
            else:
                client.update_artifact(self.markdown_id, ArtifactUpdate(data=markdown))


def nothing(fraction: float, headline: dict[str, Any] | None = None, force: bool = False) -> None:
    pass


@contextlib.contextmanager
def live_stage(stage: str) -> Iterator[Report]:
    """Yield ``report(fraction, headline)`` for the current Prefect task run (a no-op outside one).
    Nothing is created until the first report, so a stage reused from the store shows no progress
    artifact; one that ends normally shows 100%."""
    from prefect.context import FlowRunContext, TaskRunContext

    task_run = TaskRunContext.get()
    if task_run is None:
        yield nothing
        return
    flow_run = FlowRunContext.get()
    live = LiveStage(stage, task_run.task_run.id, flow_run.flow_run.id if flow_run and flow_run.flow_run else None)
    yield live
    if live.progress_id is not None:
        live(1.0, force=True)


def take_markdown_id(stage: str) -> UUID | None:
    """The live markdown artifact of this task run's stage, if one was made (finish_stage updates it)."""
    from prefect.context import TaskRunContext

    task_run = TaskRunContext.get()
    return _markdown_ids.pop((str(task_run.task_run.id), stage), None) if task_run else None
