"""Where a flow run on a shared worker may read and write, and which Dask schedulers it may use.

Whoever can trigger a deployment chooses its parameters, so on a worker a path parameter is a
request to read or write a file as the worker's user. deployments/worker.sh therefore sets
``CPUFORGE_ALLOWED_ROOTS`` (colon-separated folders): every path a run names must resolve, after
symlinks, inside one of them. A Dask scheduler exchanges pickled tasks and results with the run,
so one chosen by the caller could run code on the worker: on a confined worker
``data.dask_address`` must be listed in ``CPUFORGE_DASK_ALLOWED`` (comma-separated).

With neither variable set (the local CLI, the tests) nothing is confined: it is the user's own
machine and the user's own paths.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from urllib.parse import urlparse

from cpuforge.tasks.config.settings import Config
from cpuforge.tasks.data.corpus import HUB_PREFIX
from cpuforge.tasks.records.errors import ConfigError

ALLOWED_ROOTS_ENV = "CPUFORGE_ALLOWED_ROOTS"
DASK_ALLOWED_ENV = "CPUFORGE_DASK_ALLOWED"
DASK_SCHEME = "tcp://"


def allowed_roots() -> list[Path] | None:
    """The folders paths must stay in, resolved; None when this process is not confined."""
    value = os.environ.get(ALLOWED_ROOTS_ENV, "")
    roots = [Path(p).expanduser().resolve() for p in value.split(os.pathsep) if p.strip()]
    return roots or None


def confined(setting: str, value: str | os.PathLike) -> Path:
    """`value` as a resolved path, or ConfigError when it leads outside the allowed roots."""
    path = Path(value).expanduser().resolve()  # follows every symlink that exists, `..` included
    roots = allowed_roots()
    if roots is not None and not any(path == root or path.is_relative_to(root) for root in roots):
        raise ConfigError(f"{setting}={value} is outside the folders this worker allows "
                          f"({ALLOWED_ROOTS_ENV}={os.pathsep.join(map(str, roots))})")
    return path


def check_config_file(config_file: str | None) -> None:
    """Before the file is read: its contents would otherwise show up in the error messages."""
    if config_file:
        confined("config_file", config_file)


def check_run_paths(workdir: str, summary_path: str | None) -> None:
    confined("workdir", workdir)
    if summary_path:
        confined("summary_path", summary_path)


def check_config(cfg: Config) -> None:
    """Every setting of a resolved config that names a local path or a Dask scheduler."""
    source = cfg.data.source
    if source != "stdlib" and not source.startswith(HUB_PREFIX):
        if glob.has_magic(source):  # its files lie under the part before the first wildcard, unless `..` follows
            if ".." in Path(source).parts and allowed_roots() is not None:
                raise ConfigError(f"data.source={source}: a pattern with '..' can leave the folders this worker allows")
            source = source[:min(source.find(c) for c in "*?[" if c in source)]
        confined("data.source", source)
    if cfg.tokenizer.path:
        confined("tokenizer.path", cfg.tokenizer.path)
    init_from = cfg.train.init_from
    if init_from and init_from != "champion" and ":/" not in init_from:  # a folder, not champion or runs:/...
        confined("train.init_from", init_from)
    if cfg.tracking.uri and (store := _local_store(cfg.tracking.uri)):  # a file the run writes
        confined("tracking.uri", store)
    check_dask_address(cfg.data.dask_address)


def check_dask_address(address: str | None) -> None:
    allowed = {_normal(a) for a in os.environ.get(DASK_ALLOWED_ENV, "").split(",") if a.strip()}
    if not address or (not allowed and allowed_roots() is None):
        return
    if _normal(address) not in allowed:
        listed = ", ".join(sorted(allowed)) or "none"
        raise ConfigError(f"data.dask_address={address} is not a Dask scheduler this worker allows "
                          f"({DASK_ALLOWED_ENV}: {listed})")


def _local_store(uri: str) -> str | None:
    """The file or folder of a local MLflow store URI (sqlite:///PATH, file:PATH, a plain path)."""
    if uri.startswith("sqlite:///"):
        return uri.removeprefix("sqlite:///")
    if uri.startswith("file:"):
        return urlparse(uri).path
    return None if "://" in uri else uri


def _normal(address: str) -> str:
    address = address.strip().rstrip("/")
    return address if "://" in address else DASK_SCHEME + address
