"""File locks that a dead process can never leave held, and the machine's training slots.

Both are `flock` locks: the kernel drops them the moment the holding process dies, however it
dies (kill -9 included), so a crashed run never blocks the next one. (Prefect's tag concurrency
limits were used for training before; a run killed with SIGKILL left its slot taken in the
temporary API's database, and every later run waited forever.) A process that must wait says
what it waits for, and who holds it, every few seconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("cpuforge.locks")

REPORT_EVERY_S = 5.0
POLL_S = 0.5


def _holder_note(lock_file: Any, what: str) -> None:
    """Who holds the lock, written into the lock file for waiters to read."""
    note = {"pid": os.getpid(), "host": socket.gethostname(), "what": what, "since": time.time()}
    lock_file.seek(0)
    lock_file.truncate()
    lock_file.write(json.dumps(note))
    lock_file.flush()


def describe_holder(path: Path, patience_s: float = 1.0) -> str:
    # A holder writes its note just after taking the lock: a waiter that looks in between finds the
    # file empty, so it looks again for a moment before calling the holder "another process".
    deadline = time.monotonic() + patience_s
    while True:
        try:
            note = json.loads(path.read_text())
            return f"{note['what']} (pid {note['pid']} on {note['host']}, for {time.time() - note['since']:.0f} s)"
        except (OSError, ValueError, KeyError):
            if time.monotonic() >= deadline:
                return "another process"
            time.sleep(0.05)


def _try_lock(path: Path):
    """An open, exclusively locked file, or None if another process holds the lock."""
    handle = open(path, "a+")  # not truncated: a waiter may be reading the holder's note
    with contextlib.suppress(OSError):
        os.chmod(path, 0o666)  # another user's run on this machine must be able to take it too
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


@contextlib.contextmanager
def hold_first_free(paths: list[Path], what: str, waiting_for: str) -> Iterator[Path]:
    """Hold the first of these lock files that is free, waiting (and saying so) while none is."""
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
    started = last_report = time.monotonic()
    while True:
        for path in paths:
            handle = _try_lock(path)
            if handle is not None:
                break
        else:
            now = time.monotonic()
            if now - last_report >= REPORT_EVERY_S or last_report == started:
                holders = "; ".join(describe_holder(p) for p in paths)
                log.info("waiting %.0f s for %s, held by %s", now - started, waiting_for, holders)
                last_report = now
            time.sleep(POLL_S)
            continue
        break
    with handle:
        _holder_note(handle, what)
        try:
            yield path
        finally:
            handle.seek(0)
            handle.truncate()  # the lock is released when the file closes


def hold(path: Path, what: str, waiting_for: str):
    return hold_first_free([path], what, waiting_for)


def lock_dir() -> Path:
    """Machine-wide lock folder (every user and work folder on this machine shares the cores)."""
    folder = Path(os.environ.get("CPUFORGE_LOCK_DIR") or Path(tempfile.gettempdir()) / "cpuforge-locks")
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            folder.chmod(0o1777)  # like /tmp: every user can take a slot, none can remove another's file
    return folder


def training_slots() -> int:
    """How many trainings may run at once on this machine ($CPUFORGE_TRAINING_SLOTS, default 1: two
    trainings on the same cores would each run at half speed and finish no sooner)."""
    try:
        return max(1, int(os.environ.get("CPUFORGE_TRAINING_SLOTS", "1")))
    except ValueError:
        return 1


def training_slot(what: str):
    """Hold one of this machine's training slots for the duration of a training."""
    folder = lock_dir()
    paths = [folder / f"training-{i}.lock" for i in range(training_slots())]
    return hold_first_free(paths, what, "a training slot on this machine")
