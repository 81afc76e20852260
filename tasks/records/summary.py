"""The machine-readable summary of a pipeline run (an interface people script against:
extend it, never rename what exists).

Typed here, written as the same JSON as before: fields are emitted when they were set, so a failed
stage's entry is still just its status and error, and a run that failed before registering has no
"registry" key.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from cpuforge.models.fileio import atomic_write_json, atomic_write_text
from cpuforge.tasks.config.settings import Config
from cpuforge.tasks.infra.store import StageRecord

log = logging.getLogger("cpuforge.summary")


class StageSummary(BaseModel):
    """One stage's entry; a stage may add fields of its own (evaluate's "variants")."""

    model_config = ConfigDict(extra="allow")

    status: str  # completed | cached | failed | cancelled
    error: str | None = None
    output_dir: str | None = None
    seconds: float | None = None
    metrics: dict[str, float | int] = {}
    key: str | None = None
    mlflow_run_id: str | None = None
    # The flow process's peak resident memory while it built the stage (not a cached one's). Work in other
    # processes is not in it: torchrun workers (pretrain's and recover's own peak_rss_mb metric covers
    # training) and evaluate's measuring processes (each variant's peak_rss_mb).
    peak_rss_mb: float | None = None


class RunSummary(BaseModel):
    model_config = ConfigDict(validate_assignment=True)

    run_id: str
    mlflow_run_id: str | None = None
    profile: str
    status: str = "running"  # running | completed | failed | cancelled
    error: str | None = None
    workdir: str
    run_dir: str
    mlflow_tracking_uri: str | None = None
    mlflow_experiment_id: str | None = None
    started_at: str
    finished_at: str | None = None
    stages: dict[str, StageSummary] = {}
    flow: str | None = None  # cpuforge-pipeline's "pipeline" or the compression flow's "compress"
    pretrained_from: dict[str, Any] | None = None  # the weights the run started from, if any
    registry: dict[str, Any] | None = None  # the registered version and the champion gate's decision
    stopped_after: str | None = None  # --stop-after: the last stage run (no registration unless evaluate ran)

    def add_stage(self, record: StageRecord) -> None:
        self.stages[record.stage] = StageSummary(
            status=record.status, output_dir=record.output_dir, seconds=record.seconds, metrics=record.metrics,
            key=record.key, mlflow_run_id=record.mlflow_run_id,
            **record.summary,  # a stage's extra summary fields, e.g. evaluate's "variants"
        )

    def stage_failed(self, stage: str, status: str, exc: BaseException) -> None:
        self.stages[stage] = StageSummary(status=status, error=f"{type(exc).__name__}: {exc}")

    def as_json(self) -> dict[str, Any]:
        """The summary as it is written and returned: the fields that were set, by their names."""
        return self.model_dump(mode="json", exclude_unset=True)


def new_summary(run_id: str, cfg: Config, workdir: Path) -> RunSummary:
    return RunSummary(
        run_id=run_id, mlflow_run_id=None, profile=cfg.profile, status="running", error=None, workdir=str(workdir),
        run_dir=str(run_dir(workdir, run_id)), mlflow_tracking_uri=None, mlflow_experiment_id=None,
        started_at=_now(), finished_at=None, stages={},
    )


def run_dir(workdir: Path, run_id: str) -> Path:
    return workdir / "runs" / run_id


def write_summary(summary: RunSummary, cfg: Config, extra_path: str | None) -> Path:
    summary.finished_at = _now()
    folder = Path(summary.run_dir)
    atomic_write_text(folder / "config.yaml", cfg.to_yaml())
    atomic_write_json(folder / "summary.json", summary.as_json())
    if extra_path:
        copy = Path(extra_path).expanduser().resolve()
        try:
            atomic_write_json(copy, summary.as_json())
        except OSError as exc:  # the run's own summary is written: a missing copy must not fail a finished run
            log.warning("could not write the summary copy to %s (%s); the summary is in %s",
                        copy, exc.strerror or exc, folder / "summary.json")
    return folder / "summary.json"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
