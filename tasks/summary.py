"""The machine-readable summary of a pipeline run (an interface people script against:
extend it, never rename what exists)."""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cpuforge.models.fileio import atomic_write_json, atomic_write_text
from cpuforge.tasks.config import Config
from cpuforge.tasks.infra.store import StageRecord

log = logging.getLogger("cpuforge.summary")


def new_summary(run_id: str, cfg: Config, workdir: Path) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "mlflow_run_id": None,
        "profile": cfg.profile,
        "status": "running",
        "error": None,
        "workdir": str(workdir),
        "run_dir": str(run_dir(workdir, run_id)),
        "mlflow_tracking_uri": None,
        "mlflow_experiment_id": None,
        "started_at": _now(),
        "finished_at": None,
        "stages": {},
    }


def add_stage(summary: dict[str, Any], record: StageRecord) -> None:
    summary["stages"][record.stage] = {
        "status": record.status,
        "output_dir": record.output_dir,
        "seconds": record.seconds,
        "metrics": record.metrics,
        "key": record.key,
        "mlflow_run_id": record.mlflow_run_id,
        **record.info.get("summary", {}),  # a stage's extra summary fields, e.g. evaluate's "variants"
    }


def run_dir(workdir: Path, run_id: str) -> Path:
    return workdir / "runs" / run_id


def write_summary(summary: dict[str, Any], cfg: Config, extra_path: str | None) -> Path:
    summary["finished_at"] = _now()
    folder = Path(summary["run_dir"])
    atomic_write_text(folder / "config.yaml", cfg.to_yaml())
    atomic_write_json(folder / "summary.json", summary)
    if extra_path:
        copy = Path(extra_path).expanduser().resolve()
        try:
            atomic_write_json(copy, summary)
        except OSError as exc:  # the run's own summary is written: a missing copy must not fail a finished run
            log.warning("could not write the summary copy to %s (%s); the summary is in %s",
                        copy, exc.strerror or exc, folder / "summary.json")
    return folder / "summary.json"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
