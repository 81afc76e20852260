"""Child processes that run in a session of their own (torchrun, the compile probe), stopped whole."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever of it is still there: after the grace period if the
    leader is still running, at once if it stopped (what it started may not have)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
