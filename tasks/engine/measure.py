"""Measure model variants, each in a process of its own.

`python -m cpuforge.tasks.engine.measure --serve PARENT_PID` imports what measuring needs once (torch, onnx,
onnxruntime: about 3.5 s), then reads one request per stdin line (JSON: the ``args`` file, the ``result`` file and
the child's ``stderr`` file) and forks a child per request that measures one variant (scoring.measure_variant),
times every variant in alternation (``"speeds": true`` in the args, scoring.measure_speeds) or measures a GGUF file in
llama.cpp (``"gguf": true``, llama_cpp_measure). After each child the server writes DONE and its exit code.
A forked child starts with the server's imports but its own allocator, and its peak RSS (VmHWM) starts again at
the fork (from the server's pages it maps, the imports' memory), so each figure belongs to its variant; a tiny
run's evaluate no longer pays the imports for each of its measurements.

A fresh interpreter started here, not a multiprocessing child, which would inherit the parent's sys.path,
polluted by onnxruntime.quantization with a folder holding another package named `models`. Progress goes to
stdout, one line at a time, each starting with PROGRESS. ``MeasuringProcess`` is the other end.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cpuforge.models.fileio import atomic_write_json
from cpuforge.tasks.engine.processes import stop_process_group
from cpuforge.tasks.engine.scoring import measure_speeds, measure_variant

PROGRESS = "cpuforge-progress: "  # stdout lines the parent passes on to the person waiting
DONE = "cpuforge-measured: "  # the server's line after each child, with its exit code


def _progress(line: str) -> None:
    print(PROGRESS + line, flush=True)


def measure(args_path: str, result_path: str) -> None:
    kwargs = json.loads(Path(args_path).read_text())
    if kwargs.pop("gguf", False):  # a GGUF file in llama.cpp
        from cpuforge.tasks.engine.llama_cpp_measure import measure_gguf as run
    else:
        run = measure_speeds if kwargs.pop("speeds", False) else measure_variant
    atomic_write_json(Path(result_path), run(**kwargs, progress=_progress))


def die_with_parent(parent: int) -> None:
    """On Linux, SIGKILL this process when ``parent`` (the process that started it) dies. A run killed with
    SIGKILL cannot stop its measuring server, and a child busy loading or scoring a large model would go on
    until its next progress line (up to 30 s apart) found the pipe closed."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the signal was asked for
        os._exit(1)


def serve(parent: int) -> None:
    die_with_parent(parent)
    # Imports only: a server that ran torch or onnxruntime work would start thread pools a forked child cannot use
    import onnxruntime  # noqa: F401  (imported once here, not in every child)

    server = os.getpid()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the child never returns into the loop
            code = 1
            try:
                die_with_parent(server)
                os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
                measure(request["args"], request["result"])
                code = 0
            except BaseException:  # noqa: BLE001  (whatever it was, the parent reads it in the stderr file)
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print("\n" + DONE + str(os.waitstatus_to_exitcode(status)), flush=True)  # on a line of its own


class MeasuringProcess:
    """The measuring server (``serve``), started on entry and stopped on exit; ``measure`` runs one request.
    The server and its child run in a session of their own: leaving the block with an exception (Ctrl-C, a
    stopped run's SIGTERM, a failed measurement) stops both at once, not after the measurement. On Linux both
    also die with the process that started them, which covers a run killed with SIGKILL."""

    def __enter__(self) -> MeasuringProcess:
        self._tmp = tempfile.TemporaryDirectory(prefix="cpuforge-measure-")
        self._folder = Path(self._tmp.name)
        self._server_err = (self._folder / "server-stderr.txt").open("w+")
        self._count = 0
        self._proc = subprocess.Popen([sys.executable, "-m", __name__, "--serve", str(os.getpid())],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._server_err,
                                      text=True, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        return self._proc.pid

    def measure(self, name: str, on_progress: Callable[[str], None], **kwargs: Any) -> Any:
        """One variant's figures (``kwargs`` are the measuring function's); its progress lines go to on_progress
        as they come. A failure raises RuntimeError with the end of the child's stderr."""
        self._count += 1
        args, result, errors = (self._folder / f"{self._count}-{part}" for part in ("args.json", "result.json",
                                                                                    "stderr.txt"))
        args.write_text(json.dumps(kwargs))
        try:
            self._proc.stdin.write(json.dumps({"args": str(args), "result": str(result), "stderr": str(errors)})
                                   + "\n")  # type: ignore[union-attr]
            self._proc.stdin.flush()  # type: ignore[union-attr]
        except BrokenPipeError:
            pass  # the server is gone: said below
        code = None
        for line in self._proc.stdout:  # type: ignore[union-attr]
            if line.startswith(PROGRESS):
                on_progress(line[len(PROGRESS):].strip())
            elif line.startswith(DONE):
                code = int(line[len(DONE):])
                break
        if code is None:
            self._server_err.seek(0)
            raise RuntimeError(f"measuring variant {name} failed: the measuring process ended "
                               f"(exit {self._proc.wait()}):\n{self._server_err.read()[-3000:]}")
        if code != 0:
            text = errors.read_text(errors="replace") if errors.exists() else ""
            raise RuntimeError(f"measuring variant {name} failed (exit {code}):\n{text[-3000:]}")
        return json.loads(result.read_text())

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            if exc_type is None:  # idle between requests: it ends when its input does
                self._proc.stdin.close()  # type: ignore[union-attr]
                self._proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self._proc.poll() is None or exc_type is not None:  # the server, and a child it may be waiting on
                stop_process_group(self._proc, grace_s=5.0)
            for stream in (self._proc.stdin, self._proc.stdout, self._server_err):
                with contextlib.suppress(OSError):
                    stream.close()  # type: ignore[union-attr]
            self._tmp.cleanup()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(int(sys.argv[2]))
    else:
        measure(*sys.argv[1:3])
