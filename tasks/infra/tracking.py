"""The one module through which stages talk to MLflow.

One parent run per pipeline run, one nested run per stage. A cached stage still gets a
nested run (so every pipeline run shows all its stages), tagged ``cpuforge.cached=true``
and pointing at the run that produced the output.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cpuforge.tasks.config.settings import Config
from cpuforge.tasks.infra.locks import hold
from cpuforge.tasks.records.errors import ModelError

log = logging.getLogger("cpuforge.tracking")

DEFAULT_UI_URL = "http://127.0.0.1:5000"  # where `mlflow ui` serves the embedded store
TAG_STAGE = "cpuforge.stage"
TAG_KEY = "cpuforge.stage_key"
TAG_CACHED = "cpuforge.cached"
TAG_SOURCE_RUN = "cpuforge.source_run_id"
TAG_PROFILE = "cpuforge.profile"
# The process that owns a run, so the next run can tell an abandoned RUNNING run from a live one.
TAG_HOST = "cpuforge.host"
TAG_PID = "cpuforge.pid"
TAG_PID_STARTED = "cpuforge.pid_started"
TAG_ENDED_BY = "cpuforge.ended_by"

# mlflow.set_tracking_uri() writes MLFLOW_TRACKING_URI into os.environ, so read the user's
# value once, before we ever set it; otherwise a second run in this process would inherit
# the first run's store.
_USER_TRACKING_URI = os.environ.get("MLFLOW_TRACKING_URI")
_USER_REGISTRY_URI = os.environ.get("MLFLOW_REGISTRY_URI")


def _mlflow():
    # MLflow is imported lazily: it takes seconds, and the CLI must reject bad input faster.
    warnings.filterwarnings("ignore", module="mlflow")
    import mlflow

    return mlflow


def tracking_uri(cfg: Config, workdir: Path) -> str:
    """tracking.uri, else $MLFLOW_TRACKING_URI, else an SQLite file inside the workdir."""
    return cfg.tracking.uri or _USER_TRACKING_URI or f"sqlite:///{Path(workdir).resolve()}/mlflow.db"


def is_embedded(uri: str) -> bool:
    return uri.startswith("sqlite:")


def run_url(uri: str, experiment_id: str, run_id: str) -> str:
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else DEFAULT_UI_URL
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def download(uri: str, dst: Path, tracking_uri: str | None = None) -> Path:
    """Download a `models:/NAME@alias` (or `models:/NAME/VERSION`, `runs:/ID/PATH`) artifact into dst."""
    mlflow = _mlflow()
    from mlflow.exceptions import MlflowException

    quiet_library_progress()
    if tracking_uri:  # models:/ URIs resolve through the global registry URI, whatever is passed below
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_registry_uri(tracking_uri)
    try:
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dst)))
    except MlflowException as exc:
        raise ModelError(f"cannot fetch {uri} from the MLflow store {tracking_uri}: {exc.message}") from None


VERBOSE_ENV = "CPUFORGE_VERBOSE"  # `cpuforge run --verbose`: the libraries' own progress bars stay on
# Progress bars of the libraries a run drives (MLflow's artifact transfers when it logs and validates a model,
# datasets' and the Hub's downloads, anything on tqdm): they interleave with the run's own progress lines.
QUIET_PROGRESS = {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
                  "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}


def quiet_library_progress() -> None:
    """Turn the libraries' progress bars off for this process and the ones it starts, unless asked for
    (CPUFORGE_VERBOSE=1) or set otherwise by the user's environment."""
    if os.environ.get(VERBOSE_ENV) == "1":
        return
    for name, value in QUIET_PROGRESS.items():  # read when each library is imported (tqdm, datasets, the Hub)
        os.environ.setdefault(name, value)
    if "huggingface_hub" in sys.modules:  # already imported: tell it directly
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()


def setup(cfg: Config, workdir: Path) -> tuple[str, str]:
    """Point MLflow at the configured store and ensure the experiment exists; returns (uri, experiment id)."""
    quiet_library_progress()
    mlflow = _mlflow()
    uri = tracking_uri(cfg, workdir)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(_USER_REGISTRY_URI or uri)  # models are registered next to their runs by default
    # Two runs starting at once on a new SQLite store both ran MLflow's schema migrations and both
    # failed ("table _alembic_tmp_metrics already exists"); both could also create the experiment.
    # The first access to the store is where that happens: one process at a time.
    guard = (hold(Path(uri.removeprefix("sqlite:///") + ".lock"), "setting up the MLflow store",
                  "the MLflow store, which another cpuforge run is setting up")
             if is_embedded(uri) else contextlib.nullcontext())
    with guard:
        experiment = mlflow.get_experiment_by_name(cfg.tracking.experiment)
        if experiment is None:
            # With the embedded store, keep artifacts next to the database, not in the current folder.
            location = (Path(workdir).resolve() / "mlartifacts").as_uri() if is_embedded(uri) else None
            experiment_id = mlflow.create_experiment(cfg.tracking.experiment, artifact_location=location)
        else:
            experiment_id = experiment.experiment_id
        mlflow.MlflowClient().search_registered_models(max_results=1)  # the registry's tables, too
    mlflow.set_experiment(experiment_id=experiment_id)
    return uri, experiment_id


def _owner_tags() -> dict[str, str]:
    import psutil

    return {TAG_HOST: socket.gethostname(), TAG_PID: str(os.getpid()),
            TAG_PID_STARTED: f"{psutil.Process().create_time():.2f}"}


def _owner_alive(tags: dict[str, str]) -> bool:
    import psutil

    try:
        return f"{psutil.Process(int(tags[TAG_PID])).create_time():.2f}" == tags.get(TAG_PID_STARTED)
    except (psutil.NoSuchProcess, ValueError, KeyError):
        return False


def end_abandoned_runs(experiment_id: str, found_by: str) -> list[str]:
    """End as KILLED the runs of this experiment that are still RUNNING although the process on this
    machine that owned them is gone (a run killed with SIGKILL, or a machine that lost power), and
    tag each with the run that found it. Runs owned by other machines are left to them."""
    client = _mlflow().MlflowClient()
    host = socket.gethostname()
    stale = [run for run in client.search_runs(
                 [experiment_id], filter_string=f"attributes.status = 'RUNNING' and tags.`{TAG_HOST}` = '{host}'",
                 max_results=1000)
             if not _owner_alive(run.data.tags)]
    for run in stale:
        client.set_tag(run.info.run_id, TAG_ENDED_BY, found_by)
        client.set_terminated(run.info.run_id, status="KILLED")
    if stale:
        log.warning("ended %d MLflow run(s) left RUNNING by a killed process as KILLED: %s",
                    len(stale), ", ".join(f"{r.info.run_name} ({r.info.run_id})" for r in stale))
    return [run.info.run_id for run in stale]


@contextlib.contextmanager
def _killed_when_interrupted() -> Iterator[None]:
    """A run stopped by a cancellation or Ctrl-C (not an Exception) ends KILLED; one that failed, FAILED."""
    try:
        yield
    except Exception:
        raise
    except BaseException:
        _mlflow().end_run(status="KILLED")
        raise


@contextlib.contextmanager
def pipeline_run(cfg: Config, workdir: Path, run_name: str, tags: dict[str, str]) -> Iterator[str]:
    """The parent run of one pipeline run; ends FAILED if the body raises, KILLED if it is cancelled."""
    mlflow = _mlflow()
    with mlflow.start_run(run_name=run_name, tags={TAG_PROFILE: cfg.profile, **_owner_tags(), **tags}) as run, \
            _killed_when_interrupted():
        # data_source: `cpuforge runs --tracking-uri` lists it without downloading each run's config.
        mlflow.log_params({"profile": cfg.profile, "workdir": str(Path(workdir).resolve()),
                           "data_source": cfg.data.source})
        mlflow.log_text(cfg.to_yaml(), "config.yaml")
        yield run.info.run_id


@contextlib.contextmanager
def stage_run(stage: str, parent_run_id: str | None, params: dict[str, Any], key: str, system_metrics: bool) -> Iterator[str]:
    """A nested run for one stage; ends FAILED (and re-raises) if the stage fails, KILLED if cancelled."""
    mlflow = _mlflow()
    with mlflow.start_run(
        run_name=stage,
        nested=parent_run_id is not None,
        parent_run_id=parent_run_id,
        tags={TAG_STAGE: stage, TAG_KEY: key, TAG_CACHED: "false", **_owner_tags()},
        log_system_metrics=system_metrics,
    ) as run, _killed_when_interrupted():
        mlflow.log_params(params)
        yield run.info.run_id


@contextlib.contextmanager
def child_run(name: str, parent_run_id: str | None, tags: dict[str, str]) -> Iterator[str]:
    """A nested run that is not a stage (the registry's), active while the body runs; yields its id."""
    mlflow = _mlflow()
    with mlflow.start_run(run_name=name, nested=parent_run_id is not None, parent_run_id=parent_run_id,
                          tags=tags) as run, _killed_when_interrupted():
        yield run.info.run_id


def log_run_metrics(run_id: str, metrics: dict[str, float]) -> None:
    _mlflow().MlflowClient().log_batch(run_id, metrics=_metric_batch(metrics, step=0))


def set_run_tags(run_id: str, tags: dict[str, str]) -> None:
    from mlflow.entities import RunTag

    _mlflow().MlflowClient().log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def log_stage_result(run_id: str, metrics: dict[str, float], output_dir: Path, artifacts: list[str], info: dict[str, Any],
                     dataset: dict[str, Any] | None = None) -> None:
    client = _mlflow().MlflowClient()
    client.log_batch(run_id, metrics=_metric_batch(metrics, step=0))
    for name in artifacts:
        path = output_dir / name
        if path.is_dir():
            client.log_artifacts(run_id, str(path), artifact_path=name)
        else:
            client.log_artifact(run_id, str(path))
    if info:
        client.log_dict(run_id, info, "stage_info.json")
    if dataset:
        _log_dataset(run_id, dataset)


def log_cached_stage(stage: str, parent_run_id: str | None, params: dict[str, Any], key: str,
                     metrics: dict[str, float], source_run_id: str | None) -> str:
    """Record that a stage was reused: same params and metrics, a pointer to the producing run."""
    mlflow = _mlflow()
    with mlflow.start_run(
        run_name=f"{stage} (cached)",
        nested=parent_run_id is not None,
        parent_run_id=parent_run_id,
        tags={TAG_STAGE: stage, TAG_KEY: key, TAG_CACHED: "true", TAG_SOURCE_RUN: source_run_id or ""},
    ) as run:
        mlflow.log_params(params)
        mlflow.log_metrics({k: float(v) for k, v in metrics.items()})
        return run.info.run_id


def _log_dataset(run_id: str, dataset: dict[str, Any]) -> None:
    """The stage's data as an MLflow dataset input (the run page's Datasets column): a MetaDataset names the
    source and digest without copying any data. Logged with MLflow's public log_input, to the stage's run, which
    stage_run keeps active while the stage's results are logged."""
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import HuggingFaceDatasetSource, LocalArtifactDatasetSource

    mlflow = _mlflow()
    active = mlflow.active_run()
    if active is None or active.info.run_id != run_id:
        raise RuntimeError(f"a stage's dataset is logged while its run {run_id} is active, not {active}")
    if dataset["kind"] == "hub":
        source = HuggingFaceDatasetSource(path=dataset["source"], config_name=dataset.get("hf_subset"),
                                          split=dataset.get("hf_split"), revision=dataset.get("revision"))
    else:
        source = LocalArtifactDatasetSource(Path(dataset["source"]).as_uri())
    mlflow.log_input(MetaDataset(source=source, name=dataset["name"], digest=dataset["digest"]), context="train")


def _metric_batch(metrics: dict[str, float], step: int) -> list[Any]:
    from mlflow.entities import Metric

    now_ms = int(time.time() * 1000)
    return [Metric(name, float(value), now_ms, step) for name, value in metrics.items()]


class MetricLogger:
    """Per-step metrics for one run, sent in batches (one request per `every` steps, not per value),
    and at least every `every_s` seconds, so the MLflow charts of a slow training still grow live."""

    def __init__(self, tracking_uri: str, run_id: str, every: int = 20, every_s: float = 10.0) -> None:
        self.client = _mlflow().MlflowClient(tracking_uri=tracking_uri)
        self.run_id, self.every, self.every_s = run_id, every, every_s
        self.pending: list[Any] = []
        self.last_flush = time.monotonic()

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        self.pending += _metric_batch(metrics, step)
        if step % self.every == 0 or time.monotonic() - self.last_flush >= self.every_s:
            self.flush()

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        for i in range(0, len(self.pending), 1000):  # MLflow's per-request limit
            self.client.log_batch(self.run_id, metrics=self.pending[i:i + 1000])
        self.pending = []


def log_params(run_id: str, params: dict[str, Any]) -> None:
    _mlflow().MlflowClient().log_batch(run_id, params=[_param(k, v) for k, v in params.items()])


def _param(key: str, value: Any):
    from mlflow.entities import Param

    return Param(key, str(value))


def log_table(run_id: str, rows: list[dict[str, Any]], artifact_file: str) -> None:
    """Rows as an MLflow table (shown, and comparable across runs, in the run's Evaluation tab)."""
    columns = {key: [row.get(key) for row in rows] for key in rows[0]} if rows else {}
    _mlflow().log_table(data=columns, artifact_file=artifact_file, run_id=run_id)


# MLflow's run statuses, in the words of the run summaries.
_STATUS = {"FINISHED": "completed", "FAILED": "failed", "KILLED": "cancelled", "RUNNING": "running",
           "SCHEDULED": "scheduled"}


def pipeline_runs(uri: str, experiment: str, limit: int) -> list[dict[str, Any]]:
    """The newest `limit` pipeline (parent) runs in the store at `uri`, each with what its evaluate and
    register runs found: the rows of `cpuforge runs --tracking-uri`."""
    client = _mlflow().MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    ids = [found.experiment_id]
    parents = client.search_runs(ids, filter_string="tags.`cpuforge.run_id` LIKE '%'", max_results=limit,
                                 order_by=["attributes.start_time DESC"])
    rows = []
    for run in parents:
        info, tags = run.info, run.data.tags
        children = client.search_runs(ids, filter_string=f"tags.mlflow.parentRunId = '{info.run_id}'", max_results=100)
        by_stage = {child.data.tags.get(TAG_STAGE): child for child in children}
        evaluate, register = by_stage.get("evaluate"), by_stage.get("register")
        rows.append({
            "started_at": _iso(info.start_time), "run_id": tags.get("cpuforge.run_id", ""),
            "flow": tags.get("cpuforge.flow", ""), "profile": tags.get(TAG_PROFILE, run.data.params.get("profile", "")),
            "data_source": run.data.params.get("data_source", ""),
            "status": _STATUS.get(info.status, info.status.lower()),
            "seconds": round((info.end_time - info.start_time) / 1000, 1) if info.end_time else None,
            "final_val_bpb": evaluate.data.metrics.get("final_val_bpb") if evaluate else None,
            "decision": register.data.tags.get("cpuforge.gate_decision") if register else None,
            "model_version": register.data.tags.get("cpuforge.model_version") if register else None,
            "mlflow_run_id": info.run_id,
        })
    return rows


def _iso(ms: int) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat(timespec="seconds")
