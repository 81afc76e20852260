"""The stage store: one folder per stage output, named by a key over everything that determines it.

A stage builds into ``stages/<stage>-<key>.partial`` (kept across attempts, so training can
resume from its checkpoints) under an exclusive lock, and the folder is renamed to
``stages/<stage>-<key>`` only once ``record.json`` is written. A folder without ``.partial``
is therefore always complete, and the same inputs always map to the same folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, model_validator

from cpuforge.models.fileio import atomic_write_text
from cpuforge.tasks.infra.locks import hold

RECORD_FILE = "record.json"
KEY_CHARS = 16
_UMASK = os.umask(0)
os.umask(_UMASK)  # of the sha256 hex digest, in folder names; the record keeps the whole key


class StageRecord(BaseModel):
    """What a stage hands to the stages after it: paths and key numbers, never tensors."""

    stage: str
    key: str
    output_dir: str
    status: Literal["completed", "cached"] = "completed"
    seconds: float = 0.0  # wall time of this run of the stage (a cache lookup is fast)
    build_seconds: float = 0.0  # wall time it took to produce the output originally
    metrics: dict[str, float | int] = {}
    files: dict[str, str] = {}  # role -> file name inside output_dir
    info: dict[str, Any] = {}  # small extra facts (choices made, warnings), JSON-serialisable
    summary: dict[str, Any] = {}  # more fields for the stage's entry in the run summary (evaluate's "variants")
    dataset: dict[str, Any] | None = None  # the data the stage read (tokenize), for MLflow's dataset inputs
    mlflow_run_id: str | None = None  # the run that produced the output
    # What the key was computed from (version, config sections, input keys, extra, module hashes):
    # `cpuforge plan` compares them to say why a stage would be built again.
    key_parts: dict[str, Any] = {}
    created_at: str = ""

    @model_validator(mode="before")
    @classmethod
    def _read_older_records(cls, data: Any) -> Any:
        """Records written before `summary` and `dataset` were fields kept them in `info`."""
        if isinstance(data, dict) and isinstance(data.get("info"), dict):
            info = dict(data["info"])
            for name in ("summary", "dataset"):
                if name in info and name not in data:
                    data = {**data, name: info.pop(name), "info": info}
                    info = dict(data["info"])
        return data

    def path(self, role: str) -> Path:
        return Path(self.output_dir) / self.files[role]


def stage_key(stage: str, version: str, config: dict[str, Any], inputs: dict[str, str], extra: Any = None,
              code: str = "") -> str:
    """Hash of what determines a stage's output: its config sections, its inputs' keys, its code (the
    hash of its source, tasks/infra/codehash.py) and its hand-kept version."""
    payload = {"stage": stage, "version": version, "config": config, "inputs": inputs, "extra": extra, "code": code}
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class StageStore:
    def __init__(self, workdir: Path) -> None:
        self.root = Path(workdir) / "stages"

    def final_dir(self, stage: str, key: str) -> Path:
        return self.root / f"{stage}-{key[:KEY_CHARS]}"

    def lookup(self, stage: str, key: str) -> StageRecord | None:
        """The finished record for this key, or None. A folder whose record is unreadable is not finished."""
        record_path = self.final_dir(stage, key) / RECORD_FILE
        try:
            record = StageRecord.model_validate_json(record_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if record.key != key:
            return None
        # The folder may have moved with its workdir; trust where it is now.
        return record.model_copy(update={"output_dir": str(record_path.parent)})

    @contextlib.contextmanager
    def building(self, stage: str, key: str, resumable: bool = False, rebuild: bool = False) -> Iterator[Path | None]:
        """Hold the build lock of a stage output and yield its partial folder, or None when the output
        turns out to be finished once the lock is held (another process built it meanwhile: reuse it).

        A partial folder left by an interrupted attempt is kept for a resumable stage (training
        resumes from its checkpoints) and cleared for any other, which starts over. A rebuild
        always starts over; the finished folder it replaces stays until the new one is committed.
        """
        final = self.final_dir(stage, key)
        partial = final.with_name(final.name + ".partial")
        self.root.mkdir(parents=True, exist_ok=True)
        lock_path = self.root / ".locks" / f"{final.name}.lock"
        with hold(lock_path, f"building {final.name}", f"{final.name}, which another cpuforge run is building"):
            if not rebuild and self.lookup(stage, key) is not None:
                yield None
                return
            if partial.exists() and (rebuild or not resumable):
                shutil.rmtree(partial)
            partial.mkdir(exist_ok=True)
            yield partial

    def commit(self, partial: Path, record: StageRecord) -> StageRecord:
        """Write the record into the partial folder and rename it into place."""
        final = partial.with_name(partial.name.removesuffix(".partial"))
        record = record.model_copy(
            update={"output_dir": str(final), "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        )
        atomic_write_text(partial / RECORD_FILE, record.model_dump_json(indent=2))
        replaced = final.with_name(final.name + ".replaced")
        if final.exists():  # a rebuild, or an older unreadable attempt: kept aside until the new one is in place
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(partial, final)
        shutil.rmtree(replaced, ignore_errors=True)
        return record
