"""Live progress in Prefect while a stage runs: a progress artifact that grows and a markdown headline
(tokens/s, last val bits per byte, time left), both read back from a real Prefect API."""

from __future__ import annotations

import json

from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.context import TaskRunContext

from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.data import open_shards
from cpuforge.tasks.engine.training_run import PROGRESS_FILE, TrainingSpec, execute, follow_progress_file
from cpuforge.tasks.infra import live
from cpuforge.tasks.infra.publish import finish_stage
from cpuforge.tasks.infra.stage import StageContext
from cpuforge.tasks.infra.store import StageRecord
from tests.test_pretrain import shards  # noqa: F401 (module fixture: the tiny token shards)


def artifacts(key: str) -> list:
    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


def test_training_progress_grows_in_prefect_while_it_trains(shards, tmp_path, prefect_server, monkeypatch):
    # Every progress the training writes (once a second) goes to the API; after each update the value
    # the server holds is read back, so what is checked is what the UI showed during the training.
    monkeypatch.setattr(live, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(live, "MARKDOWN_EVERY_S", 0.0)
    served: list[float] = []
    headlines: list[str] = []
    publish_progress, publish_markdown = live.LiveStage._progress, live.LiveStage._markdown

    def progress_then_read_back(self):
        publish_progress(self)
        [artifact] = [a for a in artifacts("cpuforge-pretrain-progress") if a.id == self.progress_id]
        served.append(float(artifact.data))

    def markdown_then_read_back(self, markdown):
        publish_markdown(self, markdown)
        [artifact] = [a for a in artifacts("cpuforge-pretrain") if a.id == self.markdown_id]
        headlines.append(artifact.data)

    monkeypatch.setattr(live.LiveStage, "_progress", progress_then_read_back)
    monkeypatch.setattr(live.LiveStage, "_markdown", markdown_then_read_back)

    # A wall-clock budget (6 s) rather than a step count: the training lasts long enough to report several times.
    cfg = load_config("tiny", overrides=["train.max_steps=null", "train.max_tokens=null", "train.max_minutes=0.1",
                                         "train.eval_interval=5"])
    out_dir = tmp_path / "pretrain"
    out_dir.mkdir()
    vocab = open_shards(shards, cfg.model.block_size).vocab_size
    spec = TrainingSpec(kind="pretrain", train=cfg.train, model=cfg.model.shape(vocab), tokenize_dir=str(shards),
                        out_dir=str(out_dir), threads=1, peak_flops=1e12)

    @task
    def train_task():
        with live.live_stage("pretrain") as report:  # as the stage's Prefect task runs it
            result = execute(spec, report).model_dump()
        record = StageRecord(stage="pretrain", key="k", output_dir=str(out_dir), metrics={"val_bpb": result["val_bpb"]})
        finish_stage(record, StageContext(cfg=cfg, workdir=tmp_path))
        return result, TaskRunContext.get().task_run.id

    @flow
    def train_flow():
        return train_task()

    result, task_run_id = train_flow()
    assert result["steps"] > 0
    running = [v for v in served if v < 100]
    assert len(running) >= 2, served  # seen at least twice before the end
    assert running == sorted(running) and running[0] < running[-1], served
    assert served[-1] == 100.0
    live_headlines = [h for h in headlines if "running" in h]
    assert live_headlines, headlines
    assert "tokens/s" in live_headlines[-1] and "time left" in live_headlines[-1]
    assert any("last val bits per byte" in h for h in live_headlines), live_headlines
    # when the stage ends, its live headline becomes the final one: the same artifact, not a second one
    [final] = [a for a in artifacts("cpuforge-pretrain") if a.task_run_id == task_run_id]
    assert final.data.startswith("### pretrain — completed") and "val_bpb" in final.data
    # the file the training wrote for its parent holds the last state
    assert json.loads((out_dir / PROGRESS_FILE).read_text())["fraction"] == 1.0


def test_outside_a_prefect_run_reporting_does_nothing(tmp_path):
    with live.live_stage("tokenize") as report:
        report(0.5, {"chars/s": 1000.0})
    with follow_progress_file(tmp_path / "nothing.json", None):  # nothing to forward to: no thread
        pass


def test_a_running_stage_says_where_it_is_in_the_log_with_the_time_left(monkeypatch, caplog):
    """The terminal (and the flow run's log) gets a progress line every LOG_EVERY_S, whatever the Prefect API does."""
    import logging
    import uuid

    clock = [1000.0]
    monkeypatch.setattr(live.time, "monotonic", lambda: clock[0])
    stage = live.LiveStage("quantize", uuid.uuid4(), None)
    stage.broken = True  # no Prefect API here: the log line must not depend on it
    with caplog.at_level(logging.INFO, logger="cpuforge.live"):
        stage(0.1, {"phase": "quantizing"})  # at once: nothing yet, a short stage logs no progress
        clock[0] += live.LOG_EVERY_S
        stage(0.25, {"phase": "timing round 2 (at most 8)"})
        clock[0] += 1
        stage(0.3)  # within LOG_EVERY_S of the last line: nothing
    lines = [r.getMessage() for r in caplog.records if r.name == "cpuforge.live"]
    expected = live.format_seconds(3 * live.LOG_EVERY_S)  # a quarter done after LOG_EVERY_S: three times that left
    assert lines == [f"quantize 25%, {live.format_seconds(live.LOG_EVERY_S)} elapsed, about {expected} left "
                     "(phase: timing round 2 (at most 8))"]


def test_per_step_metrics_reach_mlflow_within_seconds_not_only_every_20_steps(tmp_path):
    from mlflow import MlflowClient

    from cpuforge.tasks.infra.tracking import MetricLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("live")).info.run_id
    MetricLogger(uri, run, every=1000, every_s=3600)({"train/loss": 5.0}, 1)
    assert client.get_metric_history(run, "train/loss") == []  # batched: step 1 of 1000, an hour to go
    slow = MetricLogger(uri, run, every=1000, every_s=0)  # a slow training: its time is up at every step
    slow({"train/loss": 4.0}, 2)
    slow({"train/loss": 3.0}, 3)
    assert [(m.step, m.value) for m in client.get_metric_history(run, "train/loss")] == [(2, 4.0), (3, 3.0)]
