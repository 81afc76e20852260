"""Running cpuforge unattended: retries that resume training, a concurrency limit that queues
trainings on one machine, and which errors are worth a retry."""

from __future__ import annotations

import threading
import time

from prefect import flow, task
from prefect.states import Failed

from tasks import tracking
from tasks.config import load_config
from tasks.errors import DataError
from tasks.pretrain import pretrain_task
from tasks.stage import MACHINE_TRAINING_TAG, TRAINING_TAG, StageContext, retry_unless_user_error
from tasks.tokenize import tokenize_task
from tests.conftest import make_text


def test_a_users_error_is_not_retried_and_anything_else_is():
    assert retry_unless_user_error(None, None, Failed(data=DataError("the corpus is empty"))) is False
    assert retry_unless_user_error(None, None, Failed(data=RuntimeError("torchrun exited with code -9"))) is True


def test_a_training_that_crashes_is_retried_and_resumes_from_its_last_checkpoint(tmp_path, prefect_server, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(30):
        (corpus / f"{i}.txt").write_text(make_text(i, 60))
    cfg = load_config("tiny", overrides=[f"data.source={corpus}", "train.max_minutes=null", "train.max_steps=30",
                                         "train.checkpoint_every_steps=10", "tracking.system_metrics=false"])
    workdir = tmp_path / "work"
    uri, experiment = tracking.setup(cfg, workdir)
    ctx = StageContext(cfg, workdir, None, uri, experiment)

    import tasks.trainer

    real_save, crashes = tasks.trainer.save_training_checkpoint, []

    def save_then_crash_once(root, step, *args, **kwargs):
        real_save(root, step, *args, **kwargs)
        if step == 20 and not crashes:
            crashes.append(step)
            raise RuntimeError("simulated crash after the step-20 checkpoint")

    monkeypatch.setattr(tasks.trainer, "save_training_checkpoint", save_then_crash_once)

    @flow
    def train_twice():
        tokenized = tokenize_task(ctx)
        state = pretrain_task.with_options(retry_delay_seconds=0)(ctx, tokenize=tokenized, return_state=True)
        return state.result(), state.state_details.task_run_id

    record, task_run_id = train_twice()
    assert crashes == [20]
    assert record.info["resumed_from_step"] == 20 and record.metrics["steps"] == 30

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert client.read_task_run(task_run_id).run_count == 2  # one retry, not a fresh start
    assert pretrain_task.tags == {TRAINING_TAG, MACHINE_TRAINING_TAG} and pretrain_task.retries >= 1


def test_two_trainings_on_one_machine_run_one_after_the_other(prefect_server):
    from flows.session import ensure_training_limit

    spans: list[tuple[float, float]] = []
    lock = threading.Lock()

    @task(tags=[MACHINE_TRAINING_TAG])
    def fake_training():
        start = time.monotonic()
        time.sleep(1.5)
        with lock:
            spans.append((start, time.monotonic()))

    @flow
    def two_at_once():
        ensure_training_limit()
        futures = [fake_training.submit(), fake_training.submit()]
        for f in futures:
            f.result()

    two_at_once()
    (a_start, a_end), (b_start, b_end) = sorted(spans)
    assert b_start >= a_end - 0.05, f"the trainings overlapped: {spans}"

