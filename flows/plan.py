"""`cpuforge plan`: what a run would reuse and what it would build, and why, without running anything.

Every stage's key is computed exactly as the run computes it (tasks/infra/stage.py key_parts/key_of)
from the registry's declarations. A stage whose folder exists is reused; for one that would be
built, the reason comes from comparing its key parts with those of the closest output of that stage
in the store (same inputs and settings first, then the newest): which setting, input, data or code
changed, or that there is none yet.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cpuforge.tasks import stages
from cpuforge.tasks.config.resolve import ResolvedRun
from cpuforge.tasks.infra.stage import StageSpec, key_of, key_parts
from cpuforge.tasks.infra.store import RECORD_FILE, StageRecord, StageStore

MAX_SETTINGS_SHOWN = 4
MAX_FILES_SHOWN = 4


@dataclass
class PlanRow:
    stage: str
    action: str  # "reuse" | "build"
    key: str
    folder: str = ""  # the folder reused, or the one the build will write
    reasons: list[str] = field(default_factory=list)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def _closest_record(store: StageStore, stage: str, parts: dict[str, Any]) -> StageRecord | None:
    """The output of this stage that differs least from what the run would build: the newest with the
    same inputs and settings, else the same inputs, else the same settings, else the newest at all
    (so a change is explained against the run it changes, not against another profile's)."""
    records = []
    for path in store.root.glob(f"{stage}-*/{RECORD_FILE}"):
        if path.parent.name.endswith((".partial", ".replaced")):
            continue
        try:
            records.append(StageRecord.model_validate_json(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    if not records:
        return None

    def closeness(record: StageRecord) -> tuple[bool, bool, str]:
        old = record.key_parts or {}
        return old.get("inputs") == parts["inputs"], old.get("config") == parts["config"], record.created_at

    return max(records, key=closeness)


def _source_path(module: str) -> str:
    """cpuforge.tasks.engine.trainer -> tasks/engine/trainer.py (records made before the cpuforge namespace say
    tasks.trainer); a config declaration, cpuforge.tasks.config.settings:train -> tasks/config/settings.py (train)."""
    module, _, name = module.partition(":")
    path = module.removeprefix("cpuforge.").replace(".", "/") + ".py"
    return f"{path} ({name})" if name else path


def why_build(store: StageStore, spec: StageSpec, parts: dict[str, Any], changed_inputs: list[str]) -> list[str]:
    """What differs from the closest output of this stage in the store."""
    previous = _closest_record(store, spec.name, parts)
    if previous is None:
        return ["no output of this stage yet"]
    old = previous.key_parts
    if not old:
        return [f"its closest output ({Path(previous.output_dir).name}) was made by an older cpuforge that did not "
                "record what its key was made of"]
    reasons = []
    if old.get("version") != parts["version"]:
        reasons.append(f"stage version {old.get('version')} -> {parts['version']}")
    before, after = _flatten(old.get("config", {})), _flatten(parts["config"])
    settings = [f"{k}: {json.dumps(before.get(k))} -> {json.dumps(after.get(k))}"
                for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]
    if len(settings) > MAX_SETTINGS_SHOWN:
        settings = settings[:MAX_SETTINGS_SHOWN] + [f"and {len(settings) - MAX_SETTINGS_SHOWN} more settings"]
    reasons += settings
    reasons += [f"input {name} changes" for name in changed_inputs]
    reasons += [f"input {name} differs from the closest output's" for name, key in parts["inputs"].items()
                if name not in changed_inputs and old.get("inputs", {}).get(name) != key]
    if old.get("extra") != parts["extra"]:
        what = {"corpus": "the data source's files (or the given tokenizer) changed",
                "source": "the weights it starts from changed"}.get(spec.extra, "its extra inputs changed")
        reasons.append(what)
    old_code, new_code = old.get("code", {}), parts["code"]
    edited = sorted({_source_path(m) for m in set(old_code) | set(new_code) if old_code.get(m) != new_code.get(m)})
    if edited:
        more = len(edited) - MAX_FILES_SHOWN
        reasons.append("code changed: " + ", ".join(edited[:MAX_FILES_SHOWN]) + (f" and {more} more files" if more > 0 else ""))
    return reasons or ["its closest output was made from other inputs"]


def extra_key(spec: StageSpec, run: ResolvedRun) -> tuple[Any, str | None]:
    """(the stage's extra key, or a note when it is only known once the run starts)."""
    cfg = run.cfg
    if spec.extra == "corpus":
        return run.extra_key(spec), None
    if spec.extra == "source" and spec.stands_for:
        return None, "the model it starts from is resolved when the run starts"
    if spec.extra == "source" and cfg.train.init_from:
        return None, (f"train.init_from={cfg.train.init_from} is resolved when the run starts: it is reused only "
                      "if those weights are the ones its output was trained from")
    return None, None


def plan(run: ResolvedRun, rebuild: frozenset[str] = frozenset(),
         order: tuple[StageSpec, ...] = stages.PIPELINE) -> list[PlanRow]:
    if stages.PRETRAIN in order and not run.cfg.train.init_from:  # as the run does for a new model (flows/session.py)
        run.start(None)
    cfg = run.cfg
    store = StageStore(run.workdir)
    keys: dict[str, str] = {}
    building: set[str] = set()
    rows = []
    for spec in order:
        extra, note = extra_key(spec, run)
        parts = key_parts(spec, cfg, {name: keys[name] for name in spec.needs}, extra)
        key = keys[spec.name] = key_of(spec, parts)
        folder = store.final_dir(spec.name, key)
        found = store.lookup(spec.name, key)
        if found is not None and spec.name not in rebuild and note is None:
            rows.append(PlanRow(spec.name, "reuse", key, str(folder)))
            continue
        building.add(spec.name)
        if spec.name in rebuild:
            reasons = ["--rebuild"]
        else:
            reasons = ([note] if note else []) + why_build(store, spec, parts,
                                                           [n for n in spec.needs if n in building])
        rows.append(PlanRow(spec.name, "build", key, str(folder), reasons))
    return rows


def as_json(rows: list[PlanRow]) -> str:
    return json.dumps([asdict(row) for row in rows], indent=2)
