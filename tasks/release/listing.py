"""What `cpuforge runs` and `cpuforge models` list: past pipeline runs (from a work folder's run
summaries, read as RunSummary, or from the parent runs in an MLflow store) and the registered versions with
their aliases, key figures and alias history. Rows are plain dicts: the same rows print as a table or
as JSON for scripts."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from cpuforge.tasks.infra import model_registry, tracking
from cpuforge.tasks.infra.model_registry import (
    TAG_DECISION,
    TAG_DECODE,
    TAG_FILE_BYTES,
    TAG_PARAMS,
    TAG_REASON,
    TAG_VAL_BPB,
)
from cpuforge.tasks.records.summary import RunSummary

RUN_COLUMNS = ("started_at", "profile", "data_source", "status", "seconds", "final_val_bpb", "decision", "run_id")


def runs_in_workdir(workdir: Path, limit: int) -> list[dict[str, Any]]:
    """The newest `limit` runs whose summary is in `workdir`/runs (a run writes it when it ends, however it ends)."""
    rows = []
    for path in (workdir / "runs").glob("*/summary.json"):
        try:
            summary = RunSummary.model_validate_json(path.read_bytes())
        except (OSError, ValidationError):  # not a cpuforge summary: not a run to list
            continue
        rows.append(_summary_row(summary, path.parent / "config.yaml"))
    rows.sort(key=lambda row: row["started_at"] or "", reverse=True)
    return rows[:limit]


def _summary_row(summary: RunSummary, config_path: Path) -> dict[str, Any]:
    registry = summary.registry or {}
    evaluate = summary.stages.get("evaluate")
    started, finished = summary.started_at, summary.finished_at
    return {
        "started_at": started, "run_id": summary.run_id, "flow": summary.flow or "pipeline",
        "profile": summary.profile, "data_source": _data_source(config_path),
        "status": summary.status,
        "seconds": round((datetime.fromisoformat(finished) - datetime.fromisoformat(started)).total_seconds(), 1)
        if started and finished else None,
        "final_val_bpb": evaluate.metrics.get("final_val_bpb") if evaluate else None,
        "decision": registry.get("decision"), "model_version": registry.get("version"),
        "mlflow_run_id": summary.mlflow_run_id,
    }


def _data_source(config_path: Path) -> str:
    try:
        return str(yaml.safe_load(config_path.read_text())["data"]["source"])
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return ""


def runs_in_store(uri: str, experiment: str, limit: int) -> list[dict[str, Any]]:
    return tracking.pipeline_runs(uri, experiment, limit)


def models(name: str, uri: str) -> dict[str, Any]:
    """Every version of `name` (newest first) with its key figures, and every recorded alias move.
    (Versions registered by older cpuforge lack some figures: None.)"""
    versions = []
    for v in model_registry.list_versions(name, uri):
        tags = v.pop("tags")
        versions.append({**v, "val_bpb": _number(tags.get(TAG_VAL_BPB)), "params": _number(tags.get(TAG_PARAMS)),
                         "file_bytes": _number(tags.get(TAG_FILE_BYTES)), "decode_tok_s": _number(tags.get(TAG_DECODE)),
                         "decision": tags.get(TAG_DECISION), "reason": tags.get(TAG_REASON)})
    return {"registered_model": name, "tracking_uri": uri, "versions": versions,
            "alias_history": model_registry.alias_history(name, uri)}


def _number(value: str | None) -> float | int | None:
    if value is None or value == "":
        return None
    number = float(value)
    return int(number) if number.is_integer() else number
