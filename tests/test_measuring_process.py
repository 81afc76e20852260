"""evaluate's measuring server and the child it forks per variant die with the run that started them, even when
that run is killed with SIGKILL and runs no cleanup of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")


def gone(process: psutil.Process, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:  # dead, waiting for whoever adopted it to reap it
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_a_run_killed_with_sigkill_leaves_neither_the_measuring_server_nor_its_busy_child(tmp_path):
    stuck = tmp_path / "stuck.onnx"
    os.mkfifo(stuck)  # opening it blocks until a writer comes: a child busy with no progress line to write
    run = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        from cpuforge.tasks.engine.measure import MeasuringProcess
        with MeasuringProcess() as measurer:
            print(measurer.pid, flush=True)
            measurer.measure("stuck", print, model_path={str(stuck)!r}, tokenize_dir={str(tmp_path)!r},
                             max_tokens=8, batch_sizes=[1], prompts=[], max_new_tokens=1, threads=1, seed=0)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        server = psutil.Process(int(run.stdout.readline()))
        deadline = time.monotonic() + 120
        while not server.children() and time.monotonic() < deadline:
            time.sleep(0.1)
        (child,) = server.children()
        assert not gone(child, 1.0)  # it waits on the file, as a large model's loading or scoring would
    finally:
        run.kill()
        run.wait()
    assert gone(server, 10) and gone(child, 10)
