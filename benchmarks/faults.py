"""Fault injection, the full table: `cpuforge run` (tiny profile, step budgets) broken on purpose,
then run again, and compared with an uninterrupted run.

    python benchmarks/faults.py [--repeats 3] [--only kill9,sigterm,disk,mlflow,prefect,concurrent]

Cells: kill -9 at a random moment inside each stage (--repeats times each), SIGTERM inside a
random stage, a full disk (a small tmpfs work folder, then grown), the MLflow tracking server
stopped mid-run and started again, the Prefect API server stopped mid-run and started again, and
two runs on one work folder at once. For each: runs tried, completed after rerun, results
identical to the uninterrupted run (every stage key; pretrain and recover weights bit for bit),
processes left behind, MLflow runs left RUNNING. Prints a markdown table (docs/faults.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.faults.harness import (  # noqa: E402
    STAGES,
    TRAINING,
    building,
    finished,
    kill_all,
    latest_summary,
    leftovers_after,
    leftovers_of_any_run,
    mlflow_runs,
    stage_keys,
    start_run,
    stop,
    wait_until,
    weights_digest,
)

RUN_TIMEOUT = 900


@dataclass
class Cell:
    name: str
    tried: int = 0
    completed: int = 0
    identical: int = 0
    orphans: int = 0
    running_left: int = 0
    notes: list[str] = field(default_factory=list)

    def row(self) -> str:
        ok = "all good" if self.tried and self.completed == self.identical == self.tried and not (
            self.orphans or self.running_left) else "NOT all good"
        return (f"| {self.name} | {self.tried} | {self.completed} | {self.identical} | {self.orphans} | "
                f"{self.running_left} | {ok} | {'; '.join(self.notes)} |")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Reference:
    """The uninterrupted run everything is compared with."""

    def __init__(self, root: Path, prefect_home: Path, env: dict) -> None:
        run = start_run(root / "reference", prefect_home=prefect_home, env=env)
        if run.wait(RUN_TIMEOUT) != 0:
            raise SystemExit(f"the uninterrupted reference run failed:\n{run.output()[-3000:]}")
        summary = latest_summary(root / "reference")
        self.keys = stage_keys(summary)
        self.weights = {s: weights_digest(summary, s) for s in TRAINING}

    def same(self, workdir: Path) -> tuple[bool, str]:
        summary = latest_summary(workdir)
        if summary["status"] != "completed":
            return False, f"status {summary['status']}"
        if stage_keys(summary) != self.keys:
            return False, "stage keys differ"
        for stage, digest in self.weights.items():
            if weights_digest(summary, stage) != digest:
                return False, f"{stage} weights differ"
        return True, ""


def finish(cell: Cell, ref: Reference, workdir: Path, prefect_home: Path, overrides=(), env=None) -> None:
    """Run again until done; count what was left behind."""
    rerun = start_run(workdir, overrides=list(overrides), prefect_home=prefect_home, env=env)
    code = rerun.wait(RUN_TIMEOUT)
    cell.completed += code == 0
    if code != 0:
        cell.notes.append(f"rerun exited {code}: {rerun.output().strip().splitlines()[-1][:160]}")
        return
    same, why = ref.same(workdir)
    cell.identical += same
    if not same:
        cell.notes.append(why)
    left = leftovers_after(rerun.marker, grace_s=10)
    cell.orphans += len(left)
    kill_all(left)
    cell.running_left += sum(r["status"] == "RUNNING" for r in mlflow_runs(workdir))


def interrupt_inside(stage: str, sig: int, cell: Cell, ref: Reference, root: Path, prefect_home: Path, env: dict,
                     rng) -> None:
    workdir = root / f"{cell.name.replace(' ', '-')}-{cell.tried}"
    cell.tried += 1
    attempt = start_run(workdir, prefect_home=prefect_home, env=env)
    wait_until(lambda: building(workdir, stage), attempt, RUN_TIMEOUT, f"the {stage} stage")
    time.sleep(rng.uniform(0, 1.5 if stage in ("tokenize", "prune") else 4.0))
    hit = next((s for s in STAGES if building(workdir, s) and not finished(workdir, s)), "between stages")
    seconds = stop(attempt, sig)
    if hit != stage:
        cell.notes.append(f"landed in {hit}")
    if sig == signal.SIGTERM:
        cell.notes.append(f"stopped in {seconds:.1f} s")
    left = leftovers_after(attempt.marker)
    cell.orphans += len(left)
    kill_all(left)
    finish(cell, ref, workdir, prefect_home, env=env)


def full_disk(cell: Cell, ref: Reference, root: Path, prefect_home: Path, env: dict) -> None:
    workdir = root / "disk"
    workdir.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(workdir)]).returncode != 0:
        cell.notes.append("skipped: cannot mount a tmpfs here")
        return
    try:
        cell.tried += 1
        attempt = start_run(workdir, prefect_home=prefect_home, env=env)
        code = attempt.wait(RUN_TIMEOUT)
        last = attempt.output().strip().splitlines()[-1]
        cell.notes.append(f"full disk: exit {code}, last line {last[:140]!r}")
        if "Traceback" in attempt.output().split("error:")[-1]:
            cell.notes.append("a traceback after the error line")
        cell.orphans += len(leftovers_after(attempt.marker))
        subprocess.run(["mount", "-o", "remount,size=2g", str(workdir)], check=True)
        finish(cell, ref, workdir, prefect_home, env=env)
    finally:
        subprocess.run(["umount", "-l", str(workdir)])


class Server:
    """An MLflow or Prefect server on a free loopback port, in a session of its own."""

    def __init__(self, kind: str, state: Path, prefect_home: Path) -> None:
        self.kind, self.port, self.prefect_home = kind, free_port(), prefect_home
        state.mkdir(parents=True, exist_ok=True)
        self.state = state
        base = f"http://127.0.0.1:{self.port}"
        if kind == "mlflow":
            self.cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
                        "--workers", "1", "--backend-store-uri", f"sqlite:///{state}/mlflow.db",
                        "--artifacts-destination", str(state / "artifacts")]
            self.health, self.overrides, self.env = f"{base}/health", [f"tracking.uri={base}"], {}
        else:
            self.cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port)]
            self.health, self.overrides, self.env = f"{base}/api/health", [], {"PREFECT_API_URL": f"{base}/api"}
        self.proc = self.start()

    def start(self) -> subprocess.Popen:
        proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "PREFECT_HOME": str(self.prefect_home)})
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if urllib.request.urlopen(self.health, timeout=2).status == 200:
                    self.proc = proc
                    return proc
            time.sleep(1)
        raise RuntimeError(f"the {self.kind} server did not start")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def server_outage(kind: str, cell: Cell, ref: Reference, root: Path, prefect_home: Path, env: dict) -> None:
    """Stop the tracking (MLflow) or orchestration (Prefect) server while pretraining runs, start it
    again 20 s later on the same port, and see the run through."""
    server = Server(kind, root / f"{kind}-server", prefect_home)
    env = {**env, **server.env}
    workdir = root / f"{kind}-outage"
    try:
        cell.tried += 1
        attempt = start_run(workdir, overrides=server.overrides, prefect_home=prefect_home, env=env)
        wait_until(lambda: building(workdir, "pretrain"), attempt, RUN_TIMEOUT, "pretraining")
        server.kill()
        time.sleep(20)
        server.start()
        code = attempt.wait(RUN_TIMEOUT)
        cell.notes.append(f"run through the outage: exit {code}"
                          + ("" if code == 0 else f" ({attempt.output().strip().splitlines()[-1][:140]})"))
        cell.orphans += len(leftovers_after(attempt.marker))
        if code == 0:
            cell.completed += 1
            same, why = ref.same(workdir)
            cell.identical += same
            cell.notes += [why] if why else []
        else:
            finish(cell, ref, workdir, prefect_home, server.overrides, env)
        if kind == "mlflow":  # the runs live on the server: count those left RUNNING there
            cell.running_left += sum(r["status"] == "RUNNING" for r in mlflow_runs(server.state))
    finally:
        server.kill()


def concurrent(cell: Cell, ref: Reference, root: Path, prefect_home: Path, env: dict) -> None:
    workdir = root / "concurrent"
    cell.tried += 2
    runs = [start_run(workdir, prefect_home=prefect_home, env=env, log_name=f"concurrent-{i}.log") for i in range(2)]
    codes = [r.wait(RUN_TIMEOUT) for r in runs]
    cell.completed += sum(c == 0 for c in codes)
    same, why = ref.same(workdir)
    cell.identical += 2 * same if all(c == 0 for c in codes) else 0
    cell.notes += [why] if why else []
    for r in runs:
        left = leftovers_after(r.marker, grace_s=10)
        cell.orphans += len(left)
        kill_all(left)
    cell.running_left += sum(r["status"] == "RUNNING" for r in mlflow_runs(workdir))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="kill -9 runs per stage")
    parser.add_argument("--only", default="kill9,sigterm,disk,mlflow,prefect,concurrent")
    parser.add_argument("--stages", default=",".join(STAGES), help="the stages kill -9 is aimed at")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the work folders")
    parser.add_argument("--ephemeral", action="store_true",
                        help="each run starts its own temporary Prefect API (slower) instead of sharing one server")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-ups below when stopped
    only = set(args.only.split(","))
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="cpuforge-faults-"))
    prefect_home = root / "prefect-home"
    started = time.monotonic()
    # One Prefect API for every run, unless each run should start (and leave behind) its own
    # temporary one: that case is tests/faults/test_interruptions.py's.
    shared = None if args.ephemeral else Server("prefect", root / "prefect-api", prefect_home)
    env = shared.env if shared else {}
    try:
        ref = Reference(root, prefect_home, env)
        cells: list[Cell] = []
        if "kill9" in only:
            for stage in args.stages.split(","):
                cell = Cell(f"kill -9 in {stage}")
                for _ in range(args.repeats):
                    interrupt_inside(stage, signal.SIGKILL, cell, ref, root, prefect_home, env, rng)
                cells.append(cell)
                print(cell.row(), flush=True)
        if "sigterm" in only:
            cell = Cell("SIGTERM")
            for stage in rng.sample(STAGES, k=min(args.repeats, len(STAGES))):
                interrupt_inside(stage, signal.SIGTERM, cell, ref, root, prefect_home, env, rng)
            cells.append(cell)
            print(cell.row(), flush=True)
        for name, fn in (("disk", full_disk), ("concurrent", concurrent)):
            if name in only:
                cell = Cell({"disk": "full disk (12 MB tmpfs)", "concurrent": "two runs, one work folder"}[name])
                fn(cell, ref, root, prefect_home, env)
                cells.append(cell)
                print(cell.row(), flush=True)
        if "mlflow" in only:
            cell = Cell("MLflow server stopped 20 s mid-run")
            server_outage("mlflow", cell, ref, root, prefect_home, env)
            cells.append(cell)
            print(cell.row(), flush=True)
        if "prefect" in only:
            cell = Cell("Prefect server stopped 20 s mid-run")
            server_outage("prefect", cell, ref, root, prefect_home, {})
            cells.append(cell)
            print(cell.row(), flush=True)
    finally:
        if shared:
            shared.kill()
        kill_all(leftovers_of_any_run())

    print(f"\n{len(cells)} cells in {(time.monotonic() - started) / 60:.1f} min (work folders: {root})\n")
    print("| fault | runs | completed after rerun | identical results | processes left | MLflow runs left RUNNING | verdict | notes |")
    print("|---|---|---|---|---|---|---|---|")
    for cell in cells:
        print(cell.row())
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
