"""cpuforge as a service, for real: a Prefect server, an MLflow server and a worker started by
deployments/up.sh on loopback, the flows deployed from prefect.yaml, a deployment triggered through
the Prefect API with custom parameters (as the UI's "Custom run" does), and a run cancelled mid-training.
Every process the stack started is stopped by PID at the end."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("tokenize", "pretrain", "prune", "recover", "export", "quantize", "evaluate")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process_groups(pids: dict[str, int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
        for pid in pids.values():
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(pid) for pid in pids.values()):
            time.sleep(0.3)


def alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    state = tmp_path_factory.mktemp("stack")
    prefect_port, mlflow_port = free_port(), free_port()
    env = {**os.environ, "CPUFORGE_STATE": str(state), "PREFECT_PORT": str(prefect_port),
           "MLFLOW_PORT": str(mlflow_port), "CPUFORGE_HOME": str(ROOT)}
    for name in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        env.pop(name, None)  # derived from the ports by deployments/common.sh
    pid_dir = state / "pids"
    try:
        up = subprocess.run(["bash", str(ROOT / "deployments" / "up.sh")], env=env, capture_output=True, text=True,
                            timeout=900)
        assert up.returncode == 0, f"up.sh failed:\n{up.stdout}\n{up.stderr}\n{_logs(state)}"
        yield {"state": state, "api": f"http://127.0.0.1:{prefect_port}/api",
               "mlflow": f"http://127.0.0.1:{mlflow_port}"}
    finally:
        pids = {p.stem: int(p.read_text()) for p in pid_dir.glob("*.pid")} if pid_dir.is_dir() else {}
        stop_process_groups(pids)
        still = [name for name, pid in pids.items() if alive(pid)]
        assert not still, f"still running after SIGKILL: {still}"


def _logs(state: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((state / "logs").glob("*.log")))


@contextlib.contextmanager
def prefect_client(stack):
    """A client of the stack's Prefect API (not the test session's temporary one)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: stack["api"]}), get_client(sync_client=True) as client:
        yield client


def trigger(stack, deployment: str, parameters: dict) -> uuid.UUID:
    """What the UI's Run -> Custom run does: a flow run of the deployment with the form's values."""
    with prefect_client(stack) as client:
        dep = client.read_deployment_by_name(deployment)
        return client.create_flow_run_from_deployment(dep.id, parameters=parameters).id


def wait_final(stack, flow_run_id: uuid.UUID, timeout: float):
    deadline = time.monotonic() + timeout
    with prefect_client(stack) as client:
        while time.monotonic() < deadline:
            run = client.read_flow_run(flow_run_id)
            if run.state and run.state.is_final():
                return run.state
            time.sleep(1)
    pytest.fail(f"flow run {flow_run_id} not finished after {timeout}s\n{_logs(stack['state'])}")


def test_deployments_from_prefect_yaml_are_there_with_their_schedule(stack):
    with prefect_client(stack) as client:
        weekly = client.read_deployment_by_name("cpuforge-pipeline/weekly-retrain")
        compress = client.read_deployment_by_name("cpuforge-compress/recompress")
        tiny = client.read_deployment_by_name("cpuforge-pipeline/tiny")
    assert [s.schedule.cron for s in weekly.schedules] == ["0 3 * * 0"] and weekly.schedules[0].active
    assert weekly.parameters == {"profile": "demo", "init_from": "champion"}
    assert compress.parameters["pretrained"] == "champion"
    assert tiny.work_pool_name == "cpuforge"
    form = tiny.parameter_openapi_schema["properties"]  # what the UI renders as the run form
    assert {"profile", "data_source", "pretrain_minutes", "keep_ratio", "init_from"} <= set(form)
    assert form["profile"]["enum"] == ["tiny", "demo", "full"] and form["keep_ratio"]["description"]


def test_a_triggered_run_completes_with_artifacts_runs_and_a_champion(stack, text_corpus, tmp_path):
    import mlflow

    workdir, summary_path = tmp_path / "work", tmp_path / "summary.json"
    run_id = trigger(stack, "cpuforge-pipeline/tiny", {"data_source": str(text_corpus), "keep_ratio": 0.6,
                                                       "workdir": str(workdir), "summary_path": str(summary_path)})
    state = wait_final(stack, run_id, timeout=600)
    assert state.is_completed(), f"{state}\n{_logs(stack['state'])}"
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "completed" and list(summary["stages"]) == list(STAGES)

    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with prefect_client(stack) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
    by_key = {a.key: a for a in artifacts}
    assert {f"cpuforge-{s}" for s in STAGES} | {"cpuforge-evaluation", "cpuforge-report", "cpuforge-registry"} <= set(by_key)
    for stage in STAGES:  # headline numbers and a link to the stage's run on the MLflow server
        run = summary["stages"][stage]["mlflow_run_id"]
        assert f"{stack['mlflow']}/#/experiments/" in by_key[f"cpuforge-{stage}"].data and run in by_key[f"cpuforge-{stage}"].data

    client = mlflow.MlflowClient(tracking_uri=stack["mlflow"], registry_uri=stack["mlflow"])
    parent = client.get_run(summary["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    by_stage = {r.data.tags["cpuforge.stage"]: r for r in children}
    assert set(by_stage) == {*STAGES, "register"}
    assert all(r.info.status == "FINISHED" and r.data.metrics for r in by_stage.values())
    assert by_stage["prune"].data.params["prune.keep_ratio"] == "0.6"  # the form's value reached the stage
    assert by_stage["pretrain"].data.metrics["val_bpb"] < by_stage["pretrain"].data.metrics["unigram_bpb"] * 1.2
    version = client.get_model_version_by_alias("cpuforge-lm", "champion")
    assert set(version.aliases) == {"candidate", "champion"}
    assert version.tags["cpuforge.pretrain_run_id"] == summary["stages"]["pretrain"]["mlflow_run_id"]
    assert summary["registry"]["version"] == version.version


def test_a_cancelled_run_stops_training_promptly_and_keeps_a_usable_checkpoint(stack, text_corpus, tmp_path):
    import mlflow

    from models.checkpoint import latest_valid_checkpoint, load_training_state, read_config

    workdir = tmp_path / "work"
    run_id = trigger(stack, "cpuforge-pipeline/tiny", {
        "data_source": str(text_corpus), "workdir": str(workdir),
        "overrides": ["train.max_steps=100000", "train.max_minutes=10", "train.checkpoint_every_steps=10"]})
    deadline = time.monotonic() + 300
    while not list(workdir.glob("stages/pretrain-*.partial/checkpoints/step-*")):
        assert time.monotonic() < deadline, f"no checkpoint after 300 s\n{_logs(stack['state'])}"
        time.sleep(0.5)
    time.sleep(2)  # well inside training now

    from prefect.states import Cancelling

    with prefect_client(stack) as client:
        client.set_flow_run_state(run_id, Cancelling())  # the UI's Cancel button
    cancelled_at = time.monotonic()
    state = wait_final(stack, run_id, timeout=120)
    assert state.is_cancelled(), state
    assert time.monotonic() - cancelled_at < 60  # not the 10 minutes the budget allowed

    checkpoints = next(workdir.glob("stages/pretrain-*.partial")) / "checkpoints"
    last = latest_valid_checkpoint(checkpoints)  # sha256-verified
    assert last is not None and read_config(last).n_layer > 0
    optimizer_state, trainer_state = load_training_state(last)
    assert trainer_state["step"] >= 10 and optimizer_state["state"]

    summary = json.loads(next(workdir.glob("runs/*/summary.json")).read_text())
    assert summary["status"] == "cancelled" and summary["stages"]["pretrain"]["status"] == "cancelled"
    client = mlflow.MlflowClient(tracking_uri=stack["mlflow"])
    assert client.get_run(summary["mlflow_run_id"]).info.status == "KILLED"
