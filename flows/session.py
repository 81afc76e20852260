"""What the flows share: their flat UI-form settings, one summary and one MLflow parent run per
flow run, and each stage's Prefect state."""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from prefect.runtime import flow_run

from cpuforge.tasks import stages
from cpuforge.tasks.config import Config, load_config
from cpuforge.tasks.errors import ConfigError
from cpuforge.tasks.infra import confinement, tracking
from cpuforge.tasks.infra.stage import StageContext, StageSpec
from cpuforge.tasks.infra.store import StageRecord
from cpuforge.tasks.lineage import PretrainedSource, with_source
from cpuforge.tasks.summary import add_stage, new_summary, write_summary

log = logging.getLogger("cpuforge.flow")

DEFAULT_WORKDIR = "cpuforge-runs"
Profile = Literal["tiny", "demo", "full"]
PruneStrategy = Literal["", "width", "depth", "width_then_depth"]  # "": the profile's

# The flows' flat parameters (what the Prefect UI renders as a form) and the setting each sets.
# Their defaults ("" and 0, never a valid value for these settings) mean "the profile's": plain
# types render as plain inputs, where `X | None` would render as a type switch. They are applied
# before `overrides`, so a free-form override still has the last word.
FORM_SETTINGS = {
    "data_source": "data.source",
    "pretrain_minutes": "train.max_minutes",
    "init_from": "train.init_from",
    "keep_ratio": "prune.keep_ratio",
    "prune_strategy": "prune.strategy",
    "recover_minutes": "recover.max_minutes",
}


def form_overrides(**form: Any) -> list[str]:
    """`section.key=value` overrides for the form fields that were filled in (JSON-quoted: a value
    such as `yes` or `1e3` stays the string or number that was typed)."""
    return [f"{FORM_SETTINGS[name]}={json.dumps(value)}" for name, value in form.items()
            if value not in (None, "", 0)]


def rebuild_set(rebuild: str, order: tuple[StageSpec, ...]) -> frozenset[str]:
    """`--rebuild STAGE`: that stage and every one after it ("" rebuilds nothing)."""
    if not rebuild:
        return frozenset()
    try:
        return stages.from_stage(rebuild, order)
    except ValueError as exc:
        raise ConfigError(f"rebuild: {exc}") from None


def flow_config(profile: str, config_file: str | None, overrides: Sequence[str] | None, **form: Any) -> Config:
    """The validated config of a flow run: profile, config file, the form's fields, then the overrides.
    On a confined worker every path it names must lie in the allowed folders (tasks/infra/confinement.py)."""
    confinement.check_config_file(config_file)
    cfg = load_config(profile, config_file or None, [*form_overrides(**form), *(overrides or ())])
    confinement.check_config(cfg)
    return cfg


FindPretrained = Callable[[Config, Path], "PretrainedSource | None"]


@contextlib.contextmanager
def flow_session(
    flow_name: str, cfg: Config, workdir: str, summary_path: str | None,
    find_pretrained: FindPretrained | None = None, adopt_shape: bool = False, rebuild: frozenset[str] = frozenset(),
) -> Iterator[tuple[dict[str, Any], StageContext, PretrainedSource | None]]:
    """Set up tracking, find the pretrained weights the run starts from (if any), open the MLflow parent
    run, and write the summary however the run ends. Yields (summary, stage context, pretrained source)."""
    if logging.getLogger("cpuforge").level == logging.NOTSET:  # a worker's run: stage logs reach the UI
        logging.getLogger("cpuforge").setLevel(logging.INFO)
    confinement.check_run_paths(workdir, summary_path)  # before anything is written there
    root = Path(workdir).expanduser().resolve()
    run_id = flow_run.get_id() or str(uuid.uuid4())
    summary = new_summary(run_id, cfg, root)
    summary["flow"] = flow_name
    try:
        uri, experiment_id = tracking.setup(cfg, root)
        summary.update(mlflow_tracking_uri=uri, mlflow_experiment_id=experiment_id)
        source = find_pretrained(cfg, root) if find_pretrained else None
        if source is not None:
            cfg = with_source(cfg, source, adopt_shape)
        summary["pretrained_from"] = source.as_dict() if source else None
        with tracking.pipeline_run(cfg, root, run_name=flow_run.get_name() or run_id[:8],
                                   tags={"cpuforge.run_id": run_id, "cpuforge.flow": flow_name}) as parent_run_id:
            summary["mlflow_run_id"] = parent_run_id
            tracking.end_abandoned_runs(experiment_id, found_by=f"cpuforge run {run_id} (MLflow run {parent_run_id})")
            yield summary, StageContext(cfg, root, parent_run_id, uri, experiment_id, rebuild), source
        summary["status"] = "completed"
    except Exception as exc:
        summary["status"] = "failed"
        summary["error"] = f"{type(exc).__name__}: {exc}"
        raise
    except BaseException as exc:  # cancelled from the UI (TerminationSignal) or Ctrl-C
        summary["status"] = "cancelled"
        summary["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        write_summary(summary, cfg, summary_path)


def run_stage_task(task_fn, summary: dict[str, Any], ctx: StageContext, **inputs: Any) -> StageRecord:
    """Run one stage task and add its record to the summary; a failure is recorded, then re-raised."""
    try:
        state = task_fn(ctx, **inputs, return_state=True)
        record: StageRecord = state.result()  # re-raises the stage's exception when it failed
    except Exception as exc:
        summary["stages"][task_fn.name] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        raise
    except BaseException as exc:  # cancelled: the stage stopped where it was; its last checkpoint stays
        summary["stages"][task_fn.name] = {"status": "cancelled", "error": f"{type(exc).__name__}: {exc}"}
        raise
    add_stage(summary, record)
    return record
