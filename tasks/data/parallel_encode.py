"""Encoding a big split in parallel: contiguous pieces of its documents, each encoded by a Prefect
task on a local process pool or a Dask cluster (prefect-dask), then written in document order.

Every document is encoded on its own (the end-of-document id after it), so the concatenation of
the pieces in order is byte-identical to encoding the split in one process: the runner is a matter
of speed, never of output, and is left out of the stage key. The tokenizer is trained once, in the
stage, and shipped to the workers as its JSON. Pieces come back to this process as arrays, so Dask
workers on other machines need no shared filesystem.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE
from tokenizers import Tokenizer

from cpuforge.tasks.config.settings import DataConfig
from cpuforge.tasks.data.encoding import encode_to_array
from cpuforge.tasks.engine.hardware import available_cores

log = logging.getLogger("cpuforge.tokenize")


def split_into_pieces(docs: list[str], piece_bytes: int) -> list[list[str]]:
    """Contiguous runs of documents of about piece_bytes characters each (at least one document)."""
    pieces: list[list[str]] = [[]]
    size = 0
    for doc in docs:
        if size >= piece_bytes:
            pieces.append([])
            size = 0
        pieces[-1].append(doc)
        size += len(doc)
    return [p for p in pieces if p]


@task(name="encode-piece", cache_policy=NO_CACHE, retries=1)
def encode_piece(tokenizer_json: str, docs: list[str], eod_id: int, dtype_name: str) -> np.ndarray:
    return encode_to_array(Tokenizer.from_str(tokenizer_json), docs, eod_id, np.dtype(dtype_name))


def encode_pieces(runner, tokenizer_json: str, pieces: list[list[str]], eod_id: int, dtype: np.dtype,
                  out: Path) -> int:
    """Submit every piece to the runner and append the results to out in piece order.

    The runner is used directly rather than through a subflow: a flow run's parameters are stored by
    the Prefect API (at most 512 KB), a task run's are not, and the pieces are the corpus itself.
    """
    written = 0
    with _workers_share_this_api(), runner, open(out, "wb") as f:
        futures = [runner.submit(encode_piece, {"tokenizer_json": tokenizer_json, "docs": piece, "eod_id": eod_id,
                                                "dtype_name": dtype.name}) for piece in pieces]
        for future in futures:  # pieces finish in any order; they are written in document order
            tokens = future.result()
            tokens.tofile(f)
            written += len(tokens)
    return written


def _workers_share_this_api():
    """Point worker processes at this process's Prefect API. Without a configured server (a plain
    `cpuforge run`), each worker would otherwise start a temporary API server of its own."""
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    if get_current_settings().api.url:
        return contextlib.nullcontext()
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the temporary server this process already runs (a singleton)
    server.start()
    return temporary_settings({PREFECT_API_URL: server.api_url})


# At or below this many cores the process pool loses to one process: on 2 cores it encoded at 0.45x
# (docs/scaling.md), the pool's start-up and the pieces' transfer costing more than a second core gains.
POOL_MIN_CORES = 3


def choose_runner(data: DataConfig) -> tuple[str, str]:
    """('single' | 'process' | 'dask', why). A scheduler address means Dask whatever encode_runner
    says; 'auto' takes one process where the pool would have 2 workers or fewer."""
    if data.dask_address:
        return "dask", f"data.dask_address={data.dask_address}"
    if data.encode_runner != "auto":
        return data.encode_runner, f"data.encode_runner={data.encode_runner}"
    workers = data.encode_workers or available_cores()
    if workers < POOL_MIN_CORES:
        return "single", (f"auto: {workers} worker(s) available, and a process pool on 2 cores measured 0.45x "
                          "one process")
    return "process", f"auto: a process pool of {workers} workers"


def runner_kind(data: DataConfig) -> str:
    """'single', 'process' or 'dask' (see choose_runner)."""
    return choose_runner(data)[0]


def task_runner(data: DataConfig, n_pieces: int):
    """The runner data.encode_runner names: a local process pool, or Dask (a scheduler at
    data.dask_address, else a local cluster started for this split)."""
    workers = data.encode_workers or available_cores()
    if runner_kind(data) == "dask":
        from prefect_dask import DaskTaskRunner  # the [dask] extra; flows/session.check_before_opening asks first

        if data.dask_address:
            return DaskTaskRunner(address=data.dask_address)
        return DaskTaskRunner(cluster_kwargs={"n_workers": min(workers, n_pieces), "threads_per_worker": 1,
                                              "processes": True, "dashboard_address": None})
    from prefect.task_runners import ProcessPoolTaskRunner

    return ProcessPoolTaskRunner(max_workers=min(workers, n_pieces))


def encode_split_in_parallel(tokenizer: Tokenizer, docs: list[str], eod_id: int, dtype: np.dtype, path: Path,
                             data: DataConfig) -> int:
    pieces = split_into_pieces(docs, data.piece_bytes)
    runner = task_runner(data, len(pieces))
    log.info("%s: %d pieces on %s", path.stem, len(pieces), type(runner).__name__)
    return encode_pieces(runner, tokenizer.to_str(), pieces, eod_id, dtype, path)
