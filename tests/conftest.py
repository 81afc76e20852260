"""Shared fixtures. Nothing here touches the network: corpora and 'hub' datasets are made on disk."""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import pytest

# Folders this test session makes for itself (not those inherited from a parent session), removed at its end.
_SESSION_FOLDERS: list[str] = []


def _session_folder(variable: str, prefix: str) -> None:
    if variable not in os.environ:
        os.environ[variable] = tempfile.mkdtemp(prefix=prefix)
        _SESSION_FOLDERS.append(os.environ[variable])


def pytest_unconfigure(config) -> None:
    for folder in _SESSION_FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)


# Before anything imports prefect, datasets or mlflow.
_session_folder("PREFECT_HOME", "cpuforge-prefect-")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"
os.environ["PREFECT_LOGGING_EXTRA_LOGGERS"] = "cpuforge"
os.environ["PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW"] = "ignore"
# The machine-wide training slots, for this test session only (a user's own runs are not waited for).
_session_folder("CPUFORGE_LOCK_DIR", "cpuforge-locks-")
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("MLFLOW_REGISTRY_URI", None)

WORDS = (
    "the model reads text and learns to predict the next token from bytes merges vocabulary "
    "train split validation loss cpu thread memory shard document corpus pipeline stage cache "
    "python function class return value import module error message file folder path line"
).split()


def make_text(seed: int, n_lines: int = 60) -> str:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", ":", "?", "!"]))
    return "\n".join(lines) + "\n"


@pytest.fixture
def text_corpus(tmp_path: Path) -> Path:
    """A folder of .txt/.md/.py files, with non-ASCII text and a CRLF file among them."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    for i in range(24):
        suffix = (".txt", ".md", ".py")[i % 3]
        folder = root / "sub" if i % 4 == 0 else root
        (folder / f"doc{i:02d}{suffix}").write_text(make_text(i), encoding="utf-8")
    (root / "unicode.txt").write_text("Grüße, naïve café — 日本語のテキスト 🙂\n" * 20, encoding="utf-8")
    (root / "windows.txt").write_bytes(make_text(99).replace("\n", "\r\n").encode("utf-8"))
    return root


def corpus_bytes(root: Path, suffixes=(".txt", ".md", ".py")) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.suffix in suffixes)


@pytest.fixture(scope="session")
def prefect_server():
    """One temporary Prefect API for the in-process flow runs of the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


NOBODY = 65534


def as_unprivileged(fn, *args) -> tuple[int, str]:
    """Run fn(*args) -> int in a forked child that has dropped root for 'nobody', so file permissions
    apply (root reads and writes anything). Returns (its return value, what it wrote to stderr).
    A fork, not a new interpreter: the interpreter lives under /root, which nobody cannot enter."""
    with tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:  # the child never returns into pytest
            code = 99
            try:
                os.dup2(err.fileno(), 2)
                sys.stderr = open(2, "w", closefd=False)
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                code = fn(*args)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        err.seek(0)
        return os.waitstatus_to_exitcode(status), err.read().decode("utf-8", "replace")


@pytest.fixture
def shared_tmp():
    """A folder the unprivileged user of as_unprivileged can use (pytest's tmp_path is private to root)."""
    folder = Path(tempfile.mkdtemp(prefix="cpuforge-shared-"))
    folder.chmod(0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def build_stage(name: str, cfg, out_dir: Path, source=None, **inputs):
    """Build one stage's output outside a flow, exactly as run_stage calls it: its work function with
    its declared config sections and its inputs' records (no store, no MLflow run)."""
    import importlib

    from cpuforge.tasks import stages
    from cpuforge.tasks.infra.stage import StageRun

    spec = stages.BY_NAME[name]
    out_dir.mkdir(parents=True, exist_ok=True)
    run = StageRun(out_dir=out_dir, run_id="", inputs=inputs, workdir=out_dir.parent, source=source)
    return importlib.import_module(spec.module).work(run, **{s: getattr(cfg, s) for s in spec.sections})
