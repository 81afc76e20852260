"""What the flows share: their flat UI-form settings, one summary and one MLflow parent run per
flow run, and each stage's Prefect state."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from prefect.runtime import flow_run as prefect_run

from cpuforge.tasks import stages
from cpuforge.tasks.config.resolve import ResolvedRun, resolve_run
from cpuforge.tasks.config.settings import Config
from cpuforge.tasks.data.parallel_encode import choose_runner, runner_kind
from cpuforge.tasks.engine.hardware import peak_rss_mb, reset_peak_rss
from cpuforge.tasks.infra import confinement, tracking
from cpuforge.tasks.infra.runner import stage_task
from cpuforge.tasks.infra.stage import StageContext, StageSpec
from cpuforge.tasks.infra.store import StageRecord
from cpuforge.tasks.records.errors import ConfigError
from cpuforge.tasks.records.summary import RunSummary, new_summary, write_summary
from cpuforge.tasks.release.lineage import PretrainedSource, lineage_tags
from cpuforge.tasks.release.register import register_task

log = logging.getLogger("cpuforge.flow")

DEFAULT_WORKDIR = "cpuforge-runs"
Profile = Literal["tiny", "demo", "hour", "full", "overnight"]
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
    "registered_model": "tracking.registered_model",
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


def stages_to_run(order: tuple[StageSpec, ...], stop_after: str) -> tuple[StageSpec, ...]:
    """`--stop-after STAGE`: the stages up to and including it ("" runs them all)."""
    if not stop_after:
        return order
    try:
        return stages.up_to(stop_after, order)
    except ValueError as exc:
        raise ConfigError(f"stop_after: {exc}") from None


def check_before_opening(order: tuple[StageSpec, ...], cfg: Config) -> None:
    """Settings that would fail a stage hours into the run fail now, before it opens: prune widths the gguf stage
    cannot store, and a Dask runner without its optional package."""
    if (stages.TOKENIZE in order and runner_kind(cfg.data) == "dask"
            and importlib.util.find_spec("prefect_dask") is None):
        raise ConfigError(f"tokenizing on Dask ({choose_runner(cfg.data)[1]}) needs prefect-dask: "
                          "pip install 'cpuforge[dask]'")
    if stages.GGUF in order and (misfits := cfg.prune.block_misfits(stages.GGUF_BLOCK)):
        raise ConfigError(f"{', '.join(misfits)}: the pruned model's rows would not split into the {stages.GGUF_BLOCK}-value "
                          f"blocks of the gguf stage's Q8_0 and Q4_0 files; use multiples of {stages.GGUF_BLOCK}, or "
                          "--stop-after quantize to make no GGUF files")


def resolve_flow_run(profile: str, config_file: str | None, overrides: Sequence[str] | None,
                     workdir: str = DEFAULT_WORKDIR, pretrained: str = "", **form: Any) -> ResolvedRun:
    """The resolved settings of a flow run: profile, config file, the form's fields, then the overrides."""
    return resolve_run(profile, config_file, [*form_overrides(**form), *(overrides or ())], workdir, pretrained)


FindPretrained = Callable[[Config, Path], "PretrainedSource | None"]


@contextlib.contextmanager
def flow_session(
    flow_name: str, run: ResolvedRun, workdir: str, summary_path: str | None,
    find_pretrained: FindPretrained | None = None, adopt_shape: bool = False, rebuild: frozenset[str] = frozenset(),
) -> Iterator[tuple[RunSummary, StageContext]]:
    """Set up tracking, find the pretrained weights the run starts from (if any; `run` is then final),
    open the MLflow parent run, and write the summary however the run ends. Yields (summary, stage context)."""
    if logging.getLogger("cpuforge").level == logging.NOTSET:  # a worker's run: stage logs reach the UI
        logging.getLogger("cpuforge").setLevel(logging.INFO)
    confinement.check_run_paths(workdir, summary_path)  # as given, before anything is written there
    root = run.workdir
    run_id = prefect_run.get_id() or str(uuid.uuid4())
    summary = new_summary(run_id, run.cfg, root)
    summary.flow = flow_name
    try:
        uri, experiment_id = tracking.setup(run.cfg, root)
        summary.mlflow_tracking_uri, summary.mlflow_experiment_id = uri, experiment_id
        source = find_pretrained(run.cfg, root) if find_pretrained else None
        run.start(source, adopt_shape)
        summary.pretrained_from = source.as_dict() if source else None
        with tracking.pipeline_run(run.cfg, root, run_name=prefect_run.get_name() or run_id[:8],
                                   tags={"cpuforge.run_id": run_id, "cpuforge.flow": flow_name}) as parent_run_id:
            summary.mlflow_run_id = parent_run_id
            tracking.end_abandoned_runs(experiment_id, found_by=f"cpuforge run {run_id} (MLflow run {parent_run_id})")
            yield summary, StageContext(run.cfg, root, parent_run_id, uri, experiment_id, rebuild)
        summary.status = "completed"
    except Exception as exc:
        summary.status, summary.error = "failed", f"{type(exc).__name__}: {exc}"
        raise
    except BaseException as exc:  # cancelled from the UI (TerminationSignal) or Ctrl-C
        summary.status, summary.error = "cancelled", f"{type(exc).__name__}: {exc}"
        raise
    finally:
        write_summary(summary, run.cfg, summary_path)


def run_stages(order: tuple[StageSpec, ...], summary: RunSummary, ctx: StageContext,
               run: ResolvedRun, stop_after: str = "") -> dict[str, StageRecord]:
    """Run the stages in the registry's order (up to `stop_after`, if given), each as its Prefect task given
    the records of the stages it needs, and add each record to the summary (a failure is recorded, then
    re-raised). Returns every record by the name later stages know it by (adopt's as "pretrain")."""
    records: dict[str, StageRecord] = {}
    if stop_after:
        order = stages_to_run(order, stop_after)
        summary.stopped_after = order[-1].name
    for spec in order:
        inputs = {name: records[name] for name in spec.needs}
        extra = run.extra_key(spec)  # an unreadable data source fails the run here, before the stage starts
        try:
            reset_peak_rss()
            state = stage_task(spec)(ctx, inputs, extra, run.source, return_state=True)
            record: StageRecord = state.result()  # re-raises the stage's exception when it failed
        except Exception as exc:
            summary.stage_failed(spec.name, "failed", exc)
            raise
        except BaseException as exc:  # cancelled: the stage stopped where it was; its last checkpoint stays
            summary.stage_failed(spec.name, "cancelled", exc)
            raise
        summary.add_stage(record)
        if record.status == "completed":  # built here, not reused
            summary.stages[record.stage].peak_rss_mb = round(peak_rss_mb(), 1)
        records[stages.record_name(spec)] = record
        log_on_parent_run(ctx, record)
    return records


def log_on_parent_run(ctx: StageContext, record: StageRecord) -> None:
    """What runs are compared by, on the flow's parent run (the runs table's columns, the compare view): each
    stage's seconds in this run as ``seconds/<stage>`` (a reused stage's are its lookup's), and evaluate's figures
    as they are (the final model's ``final_val_bpb``, ``final_file_bytes``, speed-ups, every variant's
    ``<variant>/<metric>``)."""
    if ctx.parent_run_id is None:
        return
    metrics = {f"seconds/{record.stage}": record.seconds}
    if record.stage == stages.EVALUATE.name:
        metrics.update({k: v for k, v in record.metrics.items() if k != "seconds"})
    try:
        tracking.log_run_metrics(ctx.parent_run_id, metrics)
    except Exception as exc:  # noqa: BLE001  a summary for the runs table is not worth failing a finished stage for
        log.warning("the parent MLflow run did not take %s's figures: %s: %s", record.stage, type(exc).__name__, exc)


REGISTRATION_NEEDS = frozenset({"tokenize", "pretrain", "quantize", "evaluate"})  # records register_task reads


def register_final(summary: RunSummary, ctx: StageContext, records: dict[str, StageRecord],
                   source: PretrainedSource | None) -> None:
    """Register the final model (quantize's, as evaluate measured it) through the champion gate; a run
    stopped before evaluate (--stop-after) registers nothing."""
    if not REGISTRATION_NEEDS <= set(records):
        log.info("stopped after %s: nothing is registered (registration needs quantize and evaluate)",
                 summary.stopped_after)
        return
    lineage = lineage_tags(ctx.cfg, records["pretrain"].mlflow_run_id, source)
    summary.registry = register_task(ctx, records["tokenize"], records["quantize"], records["evaluate"], lineage)
