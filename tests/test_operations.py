"""Running cpuforge unattended: retries that resume training, training slots that queue trainings
on one machine (and that a killed run cannot keep), and which errors are worth a retry."""

from __future__ import annotations

import logging
import multiprocessing
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from prefect import flow
from prefect.states import Crashed, Failed

from cpuforge.tasks import stages
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.infra import tracking
from cpuforge.tasks.infra.locks import training_slot
from cpuforge.tasks.infra.runner import stage_task
from cpuforge.tasks.infra.stage import TRAINING_TAG, StageContext, retry_unless_user_error
from cpuforge.tasks.records.errors import DataError
from tests.conftest import make_text


def test_a_users_error_is_not_retried_and_anything_else_is():
    assert retry_unless_user_error(None, None, Failed(data=DataError("the corpus is empty"))) is False
    assert retry_unless_user_error(None, None, Failed(data=RuntimeError("torchrun exited with code -9"))) is True
    # stopped by SIGTERM, Ctrl-C or a cancellation: the user asked it to stop, a retry would train on
    assert retry_unless_user_error(None, None, Crashed(message="aborted by a termination signal")) is False


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

    import cpuforge.tasks.engine.trainer as trainer

    real_save, crashes = trainer.save_training_checkpoint, []

    def save_then_crash_once(root, step, *args, **kwargs):
        real_save(root, step, *args, **kwargs)
        if step == 20 and not crashes:
            crashes.append(step)
            raise RuntimeError("simulated crash after the step-20 checkpoint")

    monkeypatch.setattr(trainer, "save_training_checkpoint", save_then_crash_once)

    @flow
    def train_twice():
        tokenized = stage_task(stages.TOKENIZE)(ctx, {}, stages.extra_key(stages.TOKENIZE, cfg, None))
        pretrain_task = stage_task(stages.PRETRAIN).with_options(retry_delay_seconds=0)
        state = pretrain_task(ctx, {"tokenize": tokenized}, return_state=True)
        return state.result(), state.state_details.task_run_id

    record, task_run_id = train_twice()
    assert crashes == [20]
    assert record.info["resumed_from_step"] == 20 and record.metrics["steps"] == 30

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert client.read_task_run(task_run_id).run_count == 2  # one retry, not a fresh start
    assert stage_task(stages.PRETRAIN).tags == {TRAINING_TAG} and stage_task(stages.PRETRAIN).retries >= 1


def test_two_trainings_on_one_machine_run_one_after_the_other(caplog):
    spans: list[tuple[float, float]] = []
    lock = threading.Lock()

    def fake_training(name: str):
        with training_slot(name):
            start = time.monotonic()
            time.sleep(1.5)
            with lock:
                spans.append((start, time.monotonic()))

    with caplog.at_level(logging.INFO, logger="cpuforge.locks"):
        threads = [threading.Thread(target=fake_training, args=(f"pretrain {i}",)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    (a_start, a_end), (b_start, b_end) = sorted(spans)
    assert b_start >= a_end - 0.05, f"the trainings overlapped: {spans}"
    assert "waiting" in caplog.text and "a training slot on this machine, held by pretrain" in caplog.text


def test_the_training_stages_hooks_are_the_machines_slot_and_the_mlflow_metric_logger():
    """The engine imports nothing of the pipeline: the training stages name their slot and metric sink by
    dotted path (TrainingHooks), which crosses into torchrun workers and joining machines in launch.json."""
    import pytest

    from cpuforge.tasks.engine.training_run import TrainingHooks, dotted, resolve
    from cpuforge.tasks.stages import pretrain, recover

    assert pretrain.HOOKS == recover.HOOKS
    hooks = TrainingHooks.model_validate_json(pretrain.HOOKS.model_dump_json())  # as a joining machine reads it
    assert resolve(hooks.metrics) is tracking.MetricLogger and resolve(hooks.slot) is training_slot
    with pytest.raises(ValueError, match="not importable"):
        dotted(lambda what: None)
    assert type(TrainingHooks().training_slot("no slot named")).__name__ == "nullcontext"

    spans: list[tuple[float, float]] = []

    def hold(slot) -> None:
        with slot:
            start = time.monotonic()
            time.sleep(0.5)
            spans.append((start, time.monotonic()))

    threads = [threading.Thread(target=hold, args=(slot,))
               for slot in (training_slot("pretrain here"), hooks.training_slot("pretrain x (joined)"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (_, a_end), (b_start, _) = sorted(spans)
    assert b_start >= a_end - 0.05, f"the hook's slot is not this machine's: {spans}"


def test_a_training_killed_with_sigkill_frees_its_slot_at_once(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from cpuforge.tasks.infra.locks import training_slot
        with training_slot("pretrain (killed)"):
            print("holding", flush=True)
            time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    holder.kill()
    holder.wait()
    started = time.monotonic()
    with training_slot("next run"):
        assert time.monotonic() - started < 10  # no lease to wait out: the kernel dropped the lock


def _set_up_tracking(workdir: str, barrier, results) -> None:
    from cpuforge.tasks.infra import tracking as tracking_module

    cfg = load_config("tiny")
    barrier.wait()  # both processes reach the new store at the same moment
    try:
        results.put(tracking_module.setup(cfg, Path(workdir))[1])
    except Exception as exc:  # reported to the test, which fails on it
        results.put(f"{type(exc).__name__}: {exc}")


def test_two_runs_setting_up_a_new_mlflow_store_at_once_both_succeed(tmp_path):
    """Both used to run MLflow's schema migrations on the new SQLite file at once, and both failed."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_set_up_tracking, args=(str(tmp_path), barrier, results)) for _ in range(2)]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    assert outcomes[0] == outcomes[1] and outcomes[0].isdigit(), outcomes  # one experiment, the same id
