"""Prefect-side reporting of a finished stage: its final state and a markdown artifact (the live one,
tasks/infra/live.py, updated in place when the stage reported while running)."""

from __future__ import annotations

from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.context import TaskRunContext
from prefect.states import Completed, State

from cpuforge.tasks.infra import live, tracking
from cpuforge.tasks.infra.stage import StageContext
from cpuforge.tasks.infra.store import StageRecord


def stage_markdown(record: StageRecord, mlflow_url: str | None) -> str:
    lines = [
        f"### {record.stage} — {record.status}",
        "",
        f"- output: `{record.output_dir}`",
        f"- seconds: {record.seconds:g} (built in {record.build_seconds:g})",
    ]
    if mlflow_url:
        lines.append(f"- MLflow run that produced it: [{record.mlflow_run_id}]({mlflow_url})")
    lines += ["", "| metric | value |", "|---|---|"]
    lines += [f"| {name} | {value:,} |" if isinstance(value, int) else f"| {name} | {value:.6g} |"
              for name, value in record.metrics.items()]
    return "\n".join(lines)


def finish_stage(record: StageRecord, ctx: StageContext) -> State:
    """The task's final state: 'Cached' when the store already had the output, else 'Completed'.

    The stage store, not Prefect's result cache, decides reuse, so Prefect can never hand back
    a result whose folder was deleted; the state name still shows the reuse in the UI.
    """
    if TaskRunContext.get() is not None:
        url = tracking.run_url(ctx.tracking_uri, ctx.experiment_id, record.mlflow_run_id) if record.mlflow_run_id else None
        markdown, description = stage_markdown(record, url), f"cpuforge {record.stage}: headline numbers"
        live_id = live.take_markdown_id(record.stage)
        if live_id is not None:  # the headline shown while it ran becomes the final one, in place
            with get_client(sync_client=True) as client:
                client.update_artifact(live_id, ArtifactUpdate(data=markdown, description=description))
        else:
            create_markdown_artifact(key=live.artifact_key(record.stage), markdown=markdown, description=description)
    if record.status == "cached":
        return Completed(name="Cached", data=record, message=f"reused {record.output_dir}")
    return Completed(data=record)
