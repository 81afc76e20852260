"""The MLflow model registry as cpuforge uses it: versions found by their tags, descriptions, and
aliases whose every move is recorded.

MLflow keeps only where an alias points now. So that anyone can tell which version was champion
on a given day, each move also writes one registered-model tag, ``cpuforge.alias_history.<UTC
time>.<alias>``, holding who moved it, when, from which version to which, and why. One tag per
move, not one growing list: a registered-model tag holds at most 5,000 characters on the SQL
stores, and two runs registering at once cannot overwrite each other's entries.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from cpuforge.tasks.infra.tracking import _mlflow

HISTORY_PREFIX = "cpuforge.alias_history."
# Version tags (tasks/release/register.py writes them; `cpuforge models` reads them).
TAG_SOURCE_KEY = "cpuforge.quantize_key"
TAG_VAL_BPB = "cpuforge.val_bpb"  # as the evaluate stage measured it on its val tokens
TAG_DECISION = "cpuforge.gate_decision"
TAG_REASON = "cpuforge.gate_reason"
# Key figures of the version (the evaluate stage's, on the machine that ran it).
TAG_PARAMS, TAG_FILE_BYTES, TAG_DECODE = "cpuforge.params", "cpuforge.file_bytes", "cpuforge.decode_tok_s"
MISSING = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")  # no such model, version or alias


def _client(uri: str | None = None):
    """A client for the store at `uri`, or for the one tracking.setup pointed MLflow at."""
    return _mlflow().MlflowClient(tracking_uri=uri, registry_uri=uri)


def _unless_missing(fetch: Callable[[], Any]) -> Any:
    """What ``fetch`` returns, or None where the model, version or alias it asks for does not exist."""
    from mlflow.exceptions import MlflowException

    try:
        return fetch()
    except MlflowException as exc:
        if exc.error_code in MISSING:
            return None
        raise


def version_by_alias(name: str, alias: str, uri: str | None = None):
    """The model version (with its tags) the alias points at, or None where the model or alias does not exist."""
    return _unless_missing(lambda: _client(uri).get_model_version_by_alias(name, alias))


def find_version(name: str, version_or_alias: str, uri: str | None = None):
    """A version by its number or an alias (models:/NAME/2, models:/NAME@champion), or None where there is none."""
    if not version_or_alias.isdigit():
        return version_by_alias(name, version_or_alias, uri)
    return _unless_missing(lambda: _client(uri).get_model_version(name, version_or_alias))


def alias_version(name: str, alias: str) -> str | None:
    version = version_by_alias(name, alias)
    return str(version.version) if version is not None else None


def versions_tagged(name: str, key: str, value: str) -> list[str]:
    """The versions of `name` whose tag `key` is `value`, oldest first."""
    found = [v for v in _client().search_model_versions(f"name='{name}'") if v.tags.get(key) == value]
    return [str(v.version) for v in sorted(found, key=lambda v: int(v.version))]


def tag_version(name: str, version: str, tags: dict[str, str]) -> None:
    client = _client()
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)


def describe_version(name: str, version: str, description: str) -> None:
    _client().update_model_version(name, version, description=description)


def version_aliases(name: str, version: str) -> list[str]:
    return sorted(_client().get_model_version(name, version).aliases)


def who() -> str:
    """user@host of this process (a container may have no name for its user id)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def move_alias(name: str, alias: str, version: str, why: str, run_id: str | None) -> bool:
    """Point `alias` at `version` and record the move; False (nothing recorded) if it already points there."""
    previous = alias_version(name, alias)
    if previous == version:
        return False
    client = _client()
    client.set_registered_model_alias(name, alias, version)
    now = datetime.now(timezone.utc)
    entry = {"alias": alias, "version": version, "previous": previous, "at": now.isoformat(timespec="seconds"),
             "by": who(), "why": why, "mlflow_run_id": run_id}
    client.set_registered_model_tag(name, f"{HISTORY_PREFIX}{now:%Y%m%dT%H%M%S.%f}Z.{alias}", json.dumps(entry))
    return True


def alias_history(name: str, uri: str | None = None) -> list[dict[str, Any]]:
    """Every recorded alias move of `name`, oldest first ([] where the model does not exist)."""
    from mlflow.exceptions import MlflowException

    try:
        tags = _client(uri).get_registered_model(name).tags
    except MlflowException as exc:
        if exc.error_code in MISSING:
            return []
        raise
    return [json.loads(tags[key]) for key in sorted(tags) if key.startswith(HISTORY_PREFIX)]


def list_versions(name: str, uri: str | None = None) -> list[dict[str, Any]]:
    """Every version of `name`, newest first: number, creation time, aliases, tags, description, run."""
    client = _client(uri)
    versions = client.search_model_versions(f"name='{name}'")
    if not versions:
        return []
    aliases: dict[str, list[str]] = {}
    for alias, version in client.get_registered_model(name).aliases.items():  # a search leaves them out
        aliases.setdefault(str(version), []).append(alias)
    return [{
        "version": str(v.version),
        "created_at": datetime.fromtimestamp(v.creation_timestamp / 1000, timezone.utc).isoformat(timespec="seconds"),
        "aliases": sorted(aliases.get(str(v.version), [])),
        "tags": dict(v.tags),
        "description": v.description or "",
        "mlflow_run_id": v.run_id,
    } for v in sorted(versions, key=lambda v: -int(v.version))]
