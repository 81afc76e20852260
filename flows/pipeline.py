"""The cpuforge pipeline as a Prefect flow: composition only, one line per stage."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from tasks import tracking
from tasks.config import load_config
from tasks.stage import StageContext
from tasks.store import StageRecord
from tasks.summary import add_stage, new_summary, write_summary
from tasks.evaluate import evaluate_task
from tasks.export import export_task
from tasks.pretrain import pretrain_task
from tasks.prune import prune_task
from tasks.quantize import quantize_task
from tasks.recover import recover_task
from tasks.registry import register_task
from tasks.tokenize import tokenize_task

DEFAULT_WORKDIR = "cpuforge-runs"


@flow(name="cpuforge-pipeline", log_prints=True)
def pipeline(
    profile: str = "demo",
    config_file: str | None = None,
    overrides: list[str] | None = None,
    workdir: str = DEFAULT_WORKDIR,
    summary_path: str | None = None,
) -> dict[str, Any]:
    """Raw text to a small, fast, registered model: tokenize -> pretrain -> prune -> recover -> export -> quantize
    -> evaluate, then the final model is registered in MLflow and promoted to champion if it beats the current one.

    Args:
        profile: named profile: tiny (about a minute), demo (10-15 minutes), full (hours).
        config_file: optional YAML file with config sections, applied over the profile.
        overrides: `section.key=value` settings applied last, e.g. `train.max_minutes=10`.
        workdir: folder for stage outputs, run summaries and the embedded MLflow store.
        summary_path: also write the summary JSON here.
    """
    cfg = load_config(profile, config_file, overrides or [])
    root = Path(workdir).expanduser().resolve()
    run_id = flow_run.get_id() or str(uuid.uuid4())
    summary = new_summary(run_id, cfg, root)
    try:
        uri, experiment_id = tracking.setup(cfg, root)
        summary.update(mlflow_tracking_uri=uri, mlflow_experiment_id=experiment_id)
        with tracking.pipeline_run(cfg, root, run_name=flow_run.get_name() or run_id[:8],
                                   tags={"cpuforge.run_id": run_id}) as parent_run_id:
            summary["mlflow_run_id"] = parent_run_id
            ctx = StageContext(cfg, root, parent_run_id, uri, experiment_id)

            tokenized = _stage(tokenize_task, summary, ctx)
            pretrained = _stage(pretrain_task, summary, ctx, tokenize=tokenized)
            pruned = _stage(prune_task, summary, ctx, tokenize=tokenized, pretrain=pretrained)
            recovered = _stage(recover_task, summary, ctx, tokenize=tokenized, pretrain=pretrained, prune=pruned)
            exported = _stage(export_task, summary, ctx, tokenize=tokenized, recover=recovered)
            quantized = _stage(quantize_task, summary, ctx, tokenize=tokenized, export=exported)
            evaluated = _stage(evaluate_task, summary, ctx, tokenize=tokenized, pretrain=pretrained, prune=pruned,
                               recover=recovered, export=exported, quantize=quantized)
            summary["registry"] = register_task(ctx, tokenized, quantized, evaluated)

        summary["status"] = "completed"
        return summary
    except BaseException as exc:
        summary["status"] = "failed"
        summary["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        write_summary(summary, cfg, summary_path)


def _stage(task_fn, summary: dict[str, Any], ctx: StageContext, **inputs: StageRecord) -> StageRecord:
    state = task_fn(ctx, **inputs, return_state=True)
    try:
        record: StageRecord = state.result()  # re-raises the stage's exception when it failed
    except BaseException as exc:
        summary["stages"][task_fn.name] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        raise
    add_stage(summary, record)
    return record
