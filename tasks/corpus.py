"""Where documents come from: the embedded standard-library corpus, local files, or the hub.

Plain-text files (.txt/.md/.py) are read as bytes here rather than through `datasets`' text
builder, because that builder opens files in text mode (universal newlines turn ``\\r\\n``
into ``\\n``, so the byte count no longer matches the corpus) and cannot tell a binary file
from text. Structured files and hub datasets go through `datasets.load_dataset`.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.config import DataConfig
from tasks.errors import DataError

log = logging.getLogger("cpuforge.corpus")

TEXT_SUFFIXES = (".txt", ".md", ".py")
STRUCTURED_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + tuple(STRUCTURED_BUILDERS)
HUB_PREFIX = "hf:"

# The stdlib's own tests and its generated codec tables (encodings/cp*.py: 256-line character
# maps) are excluded: large, repetitive, and not what people write.
STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}
BINARY_SNIFF_BYTES = 8192
BINARY_INVALID_SHARE = 0.10  # more undecodable bytes than this in the head: binary, not text
REPLACEMENT = "\ufffd"
REPLACEMENT_UTF8 = REPLACEMENT.encode("utf-8")


@dataclass
class Corpus:
    docs: list[str]
    kind: str  # stdlib | files | hub
    source: str  # what the user named, resolved (absolute path, stdlib path, hub id)
    fingerprint: str
    files: int = 0
    skipped: list[str] = field(default_factory=list)  # "path: reason"
    replaced_sequences: int = 0  # invalid UTF-8 sequences replaced by U+FFFD
    hub_fingerprint: str | None = None


def source_kind(data: DataConfig) -> str:
    if data.source == "stdlib":
        return "stdlib"
    if data.source.startswith(HUB_PREFIX):
        return "hub"
    return "files"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def list_source_files(data: DataConfig) -> tuple[list[Path], list[str]]:
    """The files a local or stdlib source names, in a fixed order, plus those skipped and why."""
    kind = source_kind(data)
    if kind == "stdlib":
        root = stdlib_root()
        files = sorted(
            (p for p in root.rglob("*.py") if not STDLIB_SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])),
            key=lambda p: p.relative_to(root).as_posix(),
        )
        if data.max_docs is not None and data.max_docs < len(files):
            # An even spread across the library, not just the first modules alphabetically.
            step = len(files) / data.max_docs
            files = [files[int(i * step)] for i in range(data.max_docs)]
        return files, []

    source = os.path.expanduser(data.source)
    if glob.has_magic(source):
        candidates = sorted(Path(p) for p in glob.glob(source, recursive=True) if Path(p).is_file())
        if not candidates:
            raise DataError(f"data.source: the pattern {data.source!r} matches no files")
    elif Path(source).is_dir():
        candidates = sorted(
            p for p in Path(source).rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(source).parts)
        )
    elif Path(source).is_file():
        candidates = [Path(source)]
    else:
        raise DataError(
            f"data.source: no such file or folder: {data.source!r} "
            f"(use a path, a glob, 'stdlib', or '{HUB_PREFIX}<dataset id>')"
        )

    files, skipped = [], []
    for path in candidates:
        if path.suffix.lower() in SUPPORTED_SUFFIXES:
            files.append(path.resolve())
        else:
            skipped.append(f"{path}: unsupported file type (supported: {', '.join(SUPPORTED_SUFFIXES)})")
    if not files:
        raise DataError(
            f"data.source: no {'/'.join(SUPPORTED_SUFFIXES)} files in {data.source!r}"
            + (f" ({len(skipped)} other files skipped)" if skipped else "")
        )
    if data.max_docs is not None and all(p.suffix.lower() in TEXT_SUFFIXES for p in files):
        files = files[: data.max_docs]
    return files, skipped


def source_fingerprint(data: DataConfig) -> str:
    """A cheap fingerprint of the source that changes when its files change (paths, sizes, mtimes).

    Part of the tokenize stage key, so new or edited data re-tokenizes and unchanged data does not.
    """
    h = hashlib.sha256()
    kind = source_kind(data)
    h.update(kind.encode())
    if kind == "hub":
        # Without network we cannot ask the hub for a revision; the id, subset, split and cap name it.
        h.update(json.dumps([data.source, data.hf_subset, data.hf_split, data.max_docs]).encode())
        return h.hexdigest()
    files, _ = list_source_files(data)
    if kind == "stdlib":
        h.update(sys.version.encode())
    for path in files:
        st = path.stat()
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def load_corpus(data: DataConfig, cache_dir: Path) -> Corpus:
    """Read every document of the source into memory, skipping and reporting what is not text."""
    kind = source_kind(data)
    if kind == "hub":
        return _load_hub(data, cache_dir)

    files, skipped = list_source_files(data)
    docs: list[str] = []
    replaced = 0
    for path in files:
        if data.max_docs is not None and len(docs) >= data.max_docs:
            break
        if path.suffix.lower() in TEXT_SUFFIXES:
            text, n_replaced, why_not = read_text_file(path)
            if why_not:
                skipped.append(f"{path}: {why_not}")
                log.warning("skipping %s: %s", path, why_not)
                continue
            if n_replaced:
                log.warning("%s: replaced %d invalid UTF-8 sequence(s) with U+FFFD", path, n_replaced)
                replaced += n_replaced
            if text.strip():
                docs.append(text)
        else:
            docs.extend(_load_structured(path, data, cache_dir, skipped))
    if data.max_docs is not None:
        docs = docs[: data.max_docs]

    resolved = str(stdlib_root()) if kind == "stdlib" else str(Path(os.path.expanduser(data.source)).resolve())
    corpus = Corpus(
        docs=docs, kind=kind, source=resolved, fingerprint=source_fingerprint(data),
        files=len(files), skipped=skipped, replaced_sequences=replaced,
    )
    _require_text(corpus, data)
    return corpus


def read_text_file(path: Path) -> tuple[str, int, str | None]:
    """(text, invalid sequences replaced, reason to skip or None)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        return "", 0, f"unreadable ({exc.strerror})"
    head = raw[:BINARY_SNIFF_BYTES]
    if b"\x00" in head:
        return "", 0, "binary (contains NUL bytes)"
    head_text = head.decode("utf-8", errors="replace")
    invalid_in_head = head_text.count(REPLACEMENT) - head.count(REPLACEMENT_UTF8)
    if head and invalid_in_head / len(head) > BINARY_INVALID_SHARE:
        return "", 0, "binary (mostly not UTF-8)"
    try:
        return raw.decode("utf-8"), 0, None
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        return text, text.count(REPLACEMENT) - raw.count(REPLACEMENT_UTF8), None


def _load_structured(path: Path, data: DataConfig, cache_dir: Path, skipped: list[str]) -> list[str]:
    import datasets  # heavy; only when structured files are used

    builder = STRUCTURED_BUILDERS[path.suffix.lower()]
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=str(cache_dir))
    except Exception as exc:  # datasets raises many types for a malformed file
        reason = f"cannot be read as {builder}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        skipped.append(f"{path}: {reason}")
        log.warning("skipping %s: %s", path, reason)
        return []
    return _text_column(ds, data, where=str(path))


def _load_hub(data: DataConfig, cache_dir: Path) -> Corpus:
    import datasets

    dataset_id = data.source[len(HUB_PREFIX):]
    if not dataset_id:
        raise DataError(f"data.source: {data.source!r} names no dataset; use '{HUB_PREFIX}<owner>/<name>'")
    streaming = data.max_docs is not None  # read only what the cap needs instead of the whole dataset
    try:
        ds = datasets.load_dataset(
            dataset_id, name=data.hf_subset, split=data.hf_split, streaming=streaming, cache_dir=str(cache_dir)
        )
        if streaming:
            ds = ds.take(data.max_docs)
        docs = _text_column(ds, data, where=f"dataset {dataset_id!r}")
    except DataError:
        raise
    except Exception as exc:
        offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = " (offline mode is on: only datasets already in the cache can load)" if offline else (
            " (a hub dataset needs network access; check the id, data.hf_subset and data.hf_split)"
        )
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"could not load {data.source!r}: {first_line}{hint}") from None
    corpus = Corpus(
        docs=docs, kind="hub", source=dataset_id, fingerprint=source_fingerprint(data),
        hub_fingerprint=getattr(ds, "_fingerprint", None),
    )
    _require_text(corpus, data)
    return corpus


def _text_column(ds: Any, data: DataConfig, where: str) -> list[str]:
    columns = ds.column_names
    if columns is None:  # a streaming dataset learns its columns from the first row
        first = next(iter(ds), None)
        columns = list(first) if first else []
    if data.text_field not in columns:
        raise DataError(
            f"{where} has no field {data.text_field!r}; its fields are: {', '.join(columns) or '(none)'}; "
            "set data.text_field"
        )
    docs = []
    for row in ds.select_columns([data.text_field]) if hasattr(ds, "select_columns") else ds:
        value = row[data.text_field]
        if isinstance(value, str) and value.strip():
            docs.append(value)
    return docs


def _require_text(corpus: Corpus, data: DataConfig) -> None:
    if corpus.docs:
        return
    if corpus.skipped and len(corpus.skipped) >= corpus.files:
        first = "; ".join(corpus.skipped[:3])
        raise DataError(f"no decodable text in {data.source!r}: every file was skipped ({first})")
    raise DataError(f"the corpus {data.source!r} is empty: no document holds any text")
