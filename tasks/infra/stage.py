"""Running one stage: key it, reuse it if the store has it, else build it, and track it either way.

Every stage module defines ``SPEC`` (its entry in tasks/stages/__init__.py) and a plain function
``work(run: StageRun, <one argument per declared config section>) -> StageOutput``. The work function
gets its declared sections (typed) and its inputs' records, nothing else, so it cannot read a
setting that is not in its key. ``run_stage`` does the rest, so the caching, atomicity and tracking
rules live in one place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cpuforge.tasks.config.settings import Config
from cpuforge.tasks.infra import live, tracking
from cpuforge.tasks.infra.codehash import code_hash, module_hashes
from cpuforge.tasks.infra.store import StageRecord, StageStore, stage_key
from cpuforge.tasks.records.errors import UserError

log = logging.getLogger("cpuforge.stage")

# Groups the training tasks in the UI. Trainings on one machine queue through a machine-wide file
# lock (tasks/infra/locks.py: a killed run cannot leave it held), not a Prefect concurrency limit.
TRAINING_TAG = "cpuforge-training"


def retry_unless_user_error(task, task_run, state) -> bool:
    """Prefect retry condition: a bad config or input fails the same way again, anything else may not.
    A crashed run (stopped by a signal: SIGTERM, Ctrl-C, a cancellation) is never retried: the user
    asked it to stop."""
    if state.is_crashed() or state.is_cancelled():
        return False
    try:
        state.result()
    except UserError:
        return False
    except Exception:
        return True
    return True


# Where a retry can help: training (a crashed or killed torchrun, memory pressure; the retry
# resumes from the last checkpoint), and talking to a hub or an MLflow server.
TRAINING_RETRIES: dict[str, Any] = {"retries": 2, "retry_delay_seconds": 10, "retry_condition_fn": retry_unless_user_error}
SERVICE_RETRIES: dict[str, Any] = {"retries": 2, "retry_delay_seconds": 5, "retry_condition_fn": retry_unless_user_error}


@dataclass(frozen=True)
class StageSpec:
    name: str
    version: str  # an explicit override: bump when the output changes for the same inputs and code
    sections: tuple[str, ...]  # the config sections that determine its output: its work function's arguments
    module: str  # the stage's module: the hash of its source and of what it imports is in the key
    needs: tuple[str, ...] = ()  # the stages whose records it takes (their keys are in its key)
    provides: tuple[str, ...] = ()  # the named outputs later stages may read (StageRecord.path(name))
    resumable: bool = False  # keep an interrupted attempt's partial folder (training resumes from its checkpoints)
    kind: Literal["plain", "training", "service"] = "plain"  # what a retry can help with (tasks/infra/runner.py)
    evaluates: tuple[str, str] | None = None  # (variant name, output) that evaluate measures, e.g. ("pruned", "model")
    stands_for: str = ""  # the stage whose place it takes in a flow: adopt hands its record on as "pretrain"
    extra: Literal["", "corpus", "source"] = ""  # what else its key holds: the corpus' files, or the source weights


@dataclass
class StageOutput:
    """What a stage's work function returns; run_stage turns it into a StageRecord."""

    metrics: dict[str, float | int]
    files: dict[str, str]
    artifacts: list[str] = field(default_factory=list)  # names in out_dir to log to MLflow
    info: dict[str, Any] = field(default_factory=dict)  # small facts, logged as the run's stage_info.json
    summary: dict[str, Any] = field(default_factory=dict)  # more fields for the stage's entry in the run summary
    dataset: dict[str, Any] | None = None  # the data it read, logged as an MLflow dataset input


@dataclass(frozen=True)
class StageRun:
    """One build of a stage, as its work function sees it: where to write, its inputs, and the run's
    surroundings (which never change what it builds)."""

    out_dir: Path  # the stage's partial folder; committed atomically when work returns
    run_id: str  # the stage's MLflow run, for per-step metrics
    inputs: dict[str, StageRecord]  # by the names in StageSpec.needs
    workdir: Path
    tracking_uri: str = ""
    source: Any = None  # the pretrained weights the run starts from (tasks/release/lineage.py PretrainedSource), if any
    report: live.Report = live.nothing  # report(fraction, headline): the stage's live progress in Prefect

    @property
    def cache_dir(self) -> Path:
        return self.workdir / "cache"


@dataclass
class StageContext:
    """Everything a stage run needs besides its work function."""

    cfg: Config
    workdir: Path
    parent_run_id: str | None = None
    tracking_uri: str = ""
    experiment_id: str = ""
    rebuild: frozenset[str] = frozenset()  # stages to build again although the store has them

    @property
    def store(self) -> StageStore:
        return StageStore(self.workdir)

    @property
    def cache_dir(self) -> Path:
        return self.workdir / "cache"


# Settings that name where inputs come from rather than what is built: the resolved input (the
# weights' or tokenizer file's hash, in the stage's extra key) is in the key instead, so "champion" today and "champion"
# next week are not mistaken for the same weights, and a run that resolves to no weights at all
# matches one that never asked.
NOT_IN_KEY = {"train": ("init_from", "max_restarts"), "tokenizer": ("path",),
              "model": ("size",),  # the shape it names is in the key, field by field
              # where and in how many pieces the shards are encoded: they are the same bytes either way
              "data": ("encode_runner", "dask_address", "encode_workers", "piece_bytes",
                       "hf_revision")}  # the commit it resolves to is in the source fingerprint


def key_config(name: str, section: Any) -> dict[str, Any]:
    """One config section as a stage's key holds it (less the settings that only say where inputs come from)."""
    return section.model_dump(mode="json", exclude=set(NOT_IN_KEY.get(name, ())))


def stage_config(cfg: Config, spec: StageSpec) -> dict[str, Any]:
    """The config sections that determine the stage's output: part of its key."""
    return {s: key_config(s, getattr(cfg, s)) for s in spec.sections}


def stage_params(cfg: Config, spec: StageSpec) -> dict[str, Any]:
    """The stage's config sections, flattened to MLflow params ("section.key": value)."""
    params: dict[str, Any] = {}
    for section in spec.sections:
        for key, value in getattr(cfg, section).model_dump(mode="json").items():
            params[f"{section}.{key}"] = value
    return params


def key_parts(spec: StageSpec, cfg: Config, input_keys: dict[str, str], extra_key: Any = None) -> dict[str, Any]:
    """Everything a stage's key is computed from."""
    return {"version": spec.version, "config": stage_config(cfg, spec), "inputs": input_keys, "extra": extra_key,
            "code": module_hashes(spec.module, spec.sections) if spec.module else {}}


def key_of(spec: StageSpec, parts: dict[str, Any]) -> str:
    return stage_key(spec.name, parts["version"], parts["config"], parts["inputs"], parts["extra"],
                     code_hash(spec.module, spec.sections) if spec.module else "")


def run_stage(
    spec: StageSpec,
    ctx: StageContext,
    work: Callable[..., StageOutput],
    inputs: dict[str, StageRecord] | None = None,
    extra_key: Any = None,
    source: Any = None,
    report: live.Report = live.nothing,
) -> StageRecord:
    """Reuse the stage's output, or build it with ``work(run, **its declared config sections)``."""
    inputs = inputs or {}
    if set(inputs) != set(spec.needs):
        raise ValueError(f"stage {spec.name} declares inputs {spec.needs}, was given {tuple(inputs)}")
    parts = key_parts(spec, ctx.cfg, {n: r.key for n, r in inputs.items()}, extra_key)
    key = key_of(spec, parts)
    params = stage_params(ctx.cfg, spec)
    store = ctx.store
    started = time.perf_counter()

    def reuse(found: StageRecord) -> StageRecord:
        seconds = round(time.perf_counter() - started, 3)
        tracking.log_cached_stage(spec.name, ctx.parent_run_id, params, key, found.metrics, found.mlflow_run_id)
        log.info("%s: reusing %s (cached)", spec.name, found.output_dir)
        return found.model_copy(update={"status": "cached", "seconds": seconds})

    rebuild = spec.name in ctx.rebuild  # `--rebuild`: build it again even though the store has it
    found = None if rebuild else store.lookup(spec.name, key)
    if found is not None:
        return reuse(found)

    with store.building(spec.name, key, spec.resumable, rebuild=rebuild) as partial:
        if partial is not None:
            with tracking.stage_run(spec.name, ctx.parent_run_id, params, key, ctx.cfg.tracking.system_metrics) as run_id:
                run = StageRun(partial, run_id, inputs, ctx.workdir, ctx.tracking_uri, source, report)
                output = work(run, **{section: getattr(ctx.cfg, section) for section in spec.sections})
                missing = set(spec.provides) - set(output.files)
                if missing:
                    raise RuntimeError(f"stage {spec.name} declares outputs it did not write: {', '.join(sorted(missing))}")
                seconds = round(time.perf_counter() - started, 3)
                record = store.commit(
                    partial,
                    StageRecord(
                        stage=spec.name, key=key, output_dir=str(partial), seconds=seconds, build_seconds=seconds,
                        metrics=output.metrics, files=output.files, info=output.info, summary=output.summary,
                        dataset=output.dataset, mlflow_run_id=run_id, key_parts=parts,
                    ),
                )
                tracking.log_stage_result(run_id, output.metrics, Path(record.output_dir), output.artifacts, output.info,
                                          output.dataset)
            return record
    return reuse(store.lookup(spec.name, key))  # built by another process while this one waited
