"""A small watcher process: when the cpuforge process it watches ends, however it ends (kill -9
included), it stops every process that one had started and left behind.

Without it a killed `cpuforge run` orphaned Prefect's temporary API server (a uvicorn process that
kept a core busy), and could orphan torchrun workers or tokenization pool workers. Only the
watcher can clean up after a SIGKILL: the killed process runs no code of its own. It keeps a list
of the watched process's descendants, refreshed twice a second, because once their parent is
gone they are re-parented away and can no longer be found by walking the tree.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

POLL_S = 0.5
GRACE_S = 5.0


def start(pid: int | None = None) -> subprocess.Popen:
    """Start a watcher of `pid` (default: this process). It runs in a session of its own, so the
    Ctrl-C or hang-up meant for the watched process does not stop it."""
    return subprocess.Popen([sys.executable, "-m", __spec__.name, str(pid or os.getpid())],
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def watch(pid: int) -> list[int]:
    """Wait for `pid` to end, then stop its leftover descendants; returns the pids it stopped."""
    try:
        watched = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    me = os.getpid()
    known: dict[int, psutil.Process] = {}
    while _alive(watched):
        try:
            for child in watched.children(recursive=True):
                if child.pid != me:
                    known.setdefault(child.pid, child)  # psutil.Process also remembers its start time
        except psutil.NoSuchProcess:
            break
        known = {p: proc for p, proc in known.items() if _alive(proc)}
        time.sleep(POLL_S)
    leftovers = [proc for proc in known.values() if _alive(proc)]  # is_running() also rules out reused pids
    for proc in leftovers:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, still_alive = psutil.wait_procs(leftovers, timeout=GRACE_S)
    for proc in still_alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    return [proc.pid for proc in leftovers]


if __name__ == "__main__":
    stopped = watch(int(sys.argv[1]))
    if stopped:
        print(f"cpuforge: stopped {len(stopped)} process(es) left behind by pid {sys.argv[1]}: "
              f"{', '.join(map(str, stopped))}", file=sys.stderr)
