"""A user's run, broken on purpose through the real CLI: killed with SIGKILL mid-training, stopped
with SIGTERM, and two runs started on one work folder at once. Each must leave nothing behind
(no orphaned process, no MLflow run stuck RUNNING) and the next run must finish the work.
The full table (every stage, several times each) is benchmarks/faults.py."""

from __future__ import annotations

import json
import signal

import pytest

from cpuforge.models.checkpoint import latest_valid_checkpoint
from tests.faults.harness import (
    checkpoints,
    kill_all,
    latest_summary,
    leftovers_after,
    mlflow_runs,
    record_info,
    stage_keys,
    start_run,
    stop,
    wait_until,
)

pytestmark = pytest.mark.slow
RUN_TIMEOUT = 600  # a safety net for a hung run, not a speed requirement


@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory):
    """One Prefect home for the module's runs: each run still starts (and must stop) its own temporary server,
    and the database is migrated once rather than once per test."""
    return tmp_path_factory.mktemp("prefect-home")


def test_a_run_killed_mid_training_leaves_nothing_behind_and_the_rerun_resumes(tmp_path, prefect_home):
    workdir = tmp_path / "work"
    killed = start_run(workdir, prefect_home=prefect_home)
    wait_until(lambda: checkpoints(workdir, "pretrain"), killed, RUN_TIMEOUT, "a pretraining checkpoint")
    killed.proc.kill()
    killed.proc.wait()

    orphans = leftovers_after(killed.marker)
    kill_all(orphans)
    assert not orphans, f"processes left behind by the killed run: {[p.cmdline() for p in orphans]}"
    assert {r["status"] for r in mlflow_runs(workdir) if r["name"] in ("pretrain",)} == {"RUNNING"}

    rerun = start_run(workdir, prefect_home=prefect_home, args=["--stop-after", "pretrain"])  # the stage it killed
    assert rerun.wait(RUN_TIMEOUT) == 0, rerun.output()[-3000:]
    output = rerun.output()
    assert "waiting" not in output  # the killed run's training slot was not kept
    summary = latest_summary(workdir)
    assert summary["status"] == "completed" and summary["stages"]["tokenize"]["status"] == "cached"
    assert record_info(summary, "pretrain")["resumed_from_step"] > 0

    runs = mlflow_runs(workdir)
    assert not [r for r in runs if r["status"] == "RUNNING"]
    ended = [r for r in runs if "cpuforge.ended_by" in r["tags"]]
    assert {r["name"] for r in ended} >= {"pretrain"} and all(r["status"] == "KILLED" for r in ended)
    assert all(summary["run_id"] in r["tags"]["cpuforge.ended_by"] for r in ended)
    assert not leftovers_after(rerun.marker, grace_s=10)


# Compiled as well: torch.compile's guards swallow the exception a signal's handler raises in them
# (tasks/engine/stop_signals.py), and once a run trained on here after its SIGTERM.
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_sigterm_stops_a_run_within_30_seconds_and_keeps_its_last_checkpoint(tmp_path, prefect_home, compiled):
    workdir = tmp_path / "work"
    attempt = start_run(workdir, overrides=["train.max_steps=100000", f"train.compile={str(compiled).lower()}"],
                        prefect_home=prefect_home)
    wait_until(lambda: checkpoints(workdir, "pretrain"), attempt, RUN_TIMEOUT, "a pretraining checkpoint")
    seconds = stop(attempt, signal.SIGTERM)
    assert seconds < 30, f"SIGTERM took {seconds:.1f} s to stop the run"
    assert attempt.proc.returncode != 0
    assert not leftovers_after(attempt.marker)
    summary = latest_summary(workdir)
    assert summary["status"] == "cancelled" and summary["stages"]["pretrain"]["status"] == "cancelled"
    assert latest_valid_checkpoint(checkpoints(workdir, "pretrain")[-1].parent) is not None
    assert not [r for r in mlflow_runs(workdir) if r["status"] == "RUNNING"]


def test_two_runs_on_one_work_folder_both_finish_with_the_same_outputs(tmp_path, prefect_home):
    workdir = tmp_path / "work"
    first, second = (start_run(workdir, prefect_home=prefect_home, log_name=f"run-{i}.log") for i in range(2))
    assert first.wait(RUN_TIMEOUT) == 0, first.output()[-3000:]
    assert second.wait(RUN_TIMEOUT) == 0, second.output()[-3000:]
    runs = sorted((workdir / "runs").glob("*/summary.json"))
    assert len(runs) == 2
    a, b = (json.loads(p.read_text()) for p in runs)
    assert a["status"] == b["status"] == "completed"
    assert stage_keys(a) == stage_keys(b)
    built_twice = [s for s in a["stages"] if a["stages"][s]["status"] == b["stages"][s]["status"] == "completed"]
    assert not built_twice, f"stages built by both runs: {built_twice}"
