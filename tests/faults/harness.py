"""Drive `cpuforge run` as a user would, and break it: kill it at a moment inside a stage, stop it,
run two at once. Shared by tests/faults/ (the CI-sized cases) and benchmarks/faults.py (the full
table). Every process a run starts carries a marker in its environment, so whatever it leaves
behind can be found and counted."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from cpuforge.tasks import stages

ROOT = Path(__file__).resolve().parents[2]
MARKER = "CPUFORGE_FAULT_MARKER"
STAGES = tuple(stages.names())
TRAINING = tuple(spec.name for spec in stages.PIPELINE if spec.kind == "training")  # step-budgeted: bit for bit
# The tiny profile with step budgets instead of wall-clock ones, so an interrupted and an
# uninterrupted run must produce the same weights bit for bit; training long enough to be hit
# mid-stage; scoring and timing kept short (they decide nothing here).
DETERMINISTIC = ["train.max_minutes=null", "train.max_steps=240", "train.checkpoint_every_steps=40",
                 "recover.max_minutes=null", "recover.max_steps=80", "eval.max_tokens=2048", "eval.batch_sizes=[1]",
                 "eval.decode_tokens=8", "quantize.score_tokens=2048"]


STARTED: set[str] = set()  # the markers of the runs this process started


@dataclass
class Attempt:
    proc: subprocess.Popen
    marker: str
    log: Path
    started: float = field(default_factory=time.monotonic)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_run(workdir: Path, overrides: list[str] = (), prefect_home: Path | None = None,
              env: dict[str, str] | None = None, log_name: str | None = None, args: list[str] = ()) -> Attempt:
    """`cpuforge run --profile tiny [ARGS]` in a process of its own, marked so its descendants can be found."""
    marker = uuid.uuid4().hex
    STARTED.add(marker)
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir.parent / (log_name or f"{workdir.name}-{marker[:8]}.log")
    run_env = {**os.environ, **(env or {}), MARKER: marker}
    if prefect_home is not None:
        run_env["PREFECT_HOME"] = str(prefect_home)
    sets = [arg for o in [*DETERMINISTIC, *overrides] for arg in ("--set", o)]
    cmd = [sys.executable, "-m", "cpuforge.flows.cli", "run", "--profile", "tiny", "--workdir", str(workdir), *sets,
           *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=run_env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    return Attempt(proc, marker, log)


def building(workdir: Path, stage: str) -> bool:
    return any((workdir / "stages").glob(f"{stage}-*.partial"))


def finished(workdir: Path, stage: str) -> bool:
    return any(p for p in (workdir / "stages").glob(f"{stage}-*") if not p.name.endswith(".partial"))


def checkpoints(workdir: Path, stage: str) -> list[Path]:
    return sorted((workdir / "stages").glob(f"{stage}-*.partial/checkpoints/step-*"))


def wait_until(condition, attempt: Attempt, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if attempt.proc.poll() is not None:
            raise AssertionError(f"the run ended (code {attempt.proc.returncode}) before {what}:\n{attempt.output()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s:\n{attempt.output()[-3000:]}")
        time.sleep(0.05)


def stage_being_built(workdir: Path) -> str | None:
    return next((s for s in STAGES if building(workdir, s) and not finished(workdir, s)), None)


def leftovers(marker: str) -> list[psutil.Process]:
    """Live processes started by a run (they carry its marker), whoever their parent is now."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def leftovers_of_any_run() -> list[psutil.Process]:
    """Every live process that a run started by this process started (a stopped benchmark cleans up with this)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER) in STARTED:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def leftovers_after(marker: str, grace_s: float = 20.0) -> list[psutil.Process]:
    """What is still alive once the watcher has had time to stop it."""
    deadline = time.monotonic() + grace_s
    while (found := leftovers(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


def kill_all(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def mlflow_runs(workdir: Path) -> list[dict]:
    db = workdir / "mlflow.db"
    if not db.is_file():
        return []
    with sqlite3.connect(db) as con:
        rows = con.execute("select run_uuid, name, status from runs").fetchall()
        tags = con.execute("select run_uuid, key, value from tags").fetchall()
    by_run: dict[str, dict] = {r[0]: {"run_id": r[0], "name": r[1], "status": r[2], "tags": {}} for r in rows}
    for run_id, key, value in tags:
        if run_id in by_run:
            by_run[run_id]["tags"][key] = value
    return list(by_run.values())


def latest_summary(workdir: Path) -> dict:
    summaries = sorted((workdir / "runs").glob("*/summary.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(summaries[-1].read_text())


def stage_keys(summary: dict) -> dict[str, str]:
    return {name: entry.get("key") for name, entry in summary["stages"].items()}


def weights_digest(summary: dict, stage: str) -> str:
    path = Path(summary["stages"][stage]["output_dir"]) / "model" / "model.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record_info(summary: dict, stage: str) -> dict:
    return json.loads((Path(summary["stages"][stage]["output_dir"]) / "record.json").read_text())["info"]


def stop(attempt: Attempt, sig: int) -> float:
    """Send the signal; seconds until the process exited."""
    sent = time.monotonic()
    attempt.proc.send_signal(sig)
    attempt.proc.wait(timeout=300)
    return time.monotonic() - sent


SIGNALS = {"kill9": signal.SIGKILL, "sigterm": signal.SIGTERM}
