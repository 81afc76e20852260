"""Where documents come from: the embedded standard-library corpus, local files, or the hub.

Plain-text files (.txt/.md/.py) are read as bytes here rather than through `datasets`' text
builder, because that builder opens files in text mode (universal newlines turn ``\\r\\n``
into ``\\n``, so the byte count no longer matches the corpus) and cannot tell a binary file
from text. Structured files and hub datasets go through `datasets.load_dataset`.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import logging
import os
import re
import stat
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cpuforge.tasks.config.settings import Config, DataConfig
from cpuforge.tasks.records.errors import DataError

log = logging.getLogger("cpuforge.corpus")

TEXT_SUFFIXES = (".txt", ".md", ".py")
STRUCTURED_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + tuple(STRUCTURED_BUILDERS)
HUB_PREFIX = "hf:"
COMMIT = re.compile(r"[0-9a-f]{40}")  # a hub commit id: a revision that cannot move

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
    revision: str | None = None  # the hub dataset's commit that was read (None: a local folder, or unresolved)


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
    skipped: list[str] = []
    if glob.has_magic(source):
        candidates = _regular_files((Path(p) for p in glob.glob(source, recursive=True)), skipped)
        if not candidates and not skipped:
            raise DataError(f"data.source: the pattern {data.source!r} matches no files")
    elif Path(source).is_dir():
        try:
            entries = [p for p in Path(source).rglob("*")
                       if not any(part.startswith(".") for part in p.relative_to(source).parts)]
        except OSError as exc:
            raise DataError(f"data.source: cannot list the folder {data.source!r} ({exc.strerror})") from None
        candidates = _regular_files(entries, skipped)
    elif Path(source).is_file():
        candidates = [Path(source)]
    elif os.path.lexists(source):
        raise DataError(f"data.source: {data.source!r} is {_not_regular(Path(source))}; "
                        "name a regular file, a folder or a glob")
    else:
        raise DataError(
            f"data.source: no such file or folder: {data.source!r} "
            f"(use a path, a glob, 'stdlib', or '{HUB_PREFIX}<dataset id>')"
        )

    files = []
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


def _regular_files(paths: Any, skipped: list[str]) -> list[Path]:
    """Regular files (or links to one) in a fixed order; FIFOs, devices, sockets and dangling or looping
    links are recorded in `skipped`: reading a FIFO would block forever."""
    files = []
    for path in sorted(paths):
        if path.is_dir():
            continue
        if path.is_file():
            files.append(path)
        else:
            skipped.append(f"{path}: {_not_regular(path)}")
    return files


def _not_regular(path: Path) -> str:
    try:
        mode = path.stat().st_mode
    except OSError as exc:  # a dangling symlink (ENOENT) or a loop (ELOOP)
        return f"a symlink that leads nowhere ({exc.strerror})"
    kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a special file")
    return f"not a regular file ({kind})"


def source_fingerprint(data: DataConfig) -> str:
    """A cheap fingerprint of the source that changes when its files change (paths, sizes, mtimes).

    Part of the tokenize stage key, so new or edited data re-tokenizes and unchanged data does not.
    """
    h = hashlib.sha256()
    kind = source_kind(data)
    h.update(kind.encode())
    if kind == "hub":
        # The commit the revision resolves to names the data: a new commit on the hub is new data. Where it cannot
        # be resolved (a local folder, offline), the id, subset, split, cap and the revision as given name it.
        revision = hub_revision(data) or data.hf_revision
        named = [data.source, data.hf_subset, data.hf_split, data.max_docs]
        h.update(json.dumps([*named, revision] if revision else named).encode())  # unresolved: the key it always had
        return h.hexdigest()
    files, _ = list_source_files(data)
    if kind == "stdlib":
        h.update(sys.version.encode())
    for path in files:
        try:
            st = path.stat()
        except OSError:  # gone since it was listed: reading it reports the skip
            h.update(f"{path}\0gone\n".encode())
            continue
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=16)
def _resolve_revision(dataset_id: str, revision: str | None) -> str | None:
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(dataset_id, revision=revision).sha
    except Exception as exc:  # noqa: BLE001  offline, no such dataset or revision: loading says which, clearly
        log.warning("could not resolve hf:%s%s to a commit (%s: %s); the run records %s", dataset_id,
                    f"@{revision}" if revision else "", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "",
                    f"the revision as given ({revision})" if revision else "no revision")
        return None


def _env_on(name: str) -> bool:  # as huggingface_hub reads its switches
    return os.environ.get(name, "").upper() in {"1", "ON", "YES", "TRUE"}


def hub_revision(data: DataConfig) -> str | None:
    """The commit of a hub dataset that data.hf_revision (empty: the default branch) names now; None for a
    dataset folder on disk, or where the hub cannot be asked. Once per process and dataset: a run's planning and
    its tokenize stage see the same commit, and each new run (a scheduled one too) asks again."""
    dataset_id = data.source[len(HUB_PREFIX):]
    if source_kind(data) != "hub" or not dataset_id or Path(dataset_id).expanduser().exists():
        return None
    if _env_on("HF_HUB_OFFLINE") or _env_on("HF_DATASETS_OFFLINE"):
        return data.hf_revision if data.hf_revision and COMMIT.fullmatch(data.hf_revision) else None
    return _resolve_revision(dataset_id, data.hf_revision)


def load_corpus(data: DataConfig, cache_dir: Path) -> Corpus:
    """Read every document of the source into memory, skipping and reporting what is not text."""
    kind = source_kind(data)
    if kind == "hub":
        return _load_hub(data, cache_dir)

    files, skipped = list_source_files(data)
    for reason in skipped:
        if "unsupported file type" not in reason:  # other file types are expected in a folder: meta.json lists them
            log.warning("skipping %s", reason)
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
    raw, why_not = _read_regular(path)
    if why_not:
        return "", 0, why_not
    why_not = _binary_reason(raw[:BINARY_SNIFF_BYTES])
    if why_not:
        return "", 0, why_not
    try:
        return raw.decode("utf-8"), 0, None
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        return text, text.count(REPLACEMENT) - raw.count(REPLACEMENT_UTF8), None


def _read_regular(path: Path, limit: int = -1) -> tuple[bytes, str | None]:
    """The file's bytes (at most `limit`), or why it cannot be read. Opened without blocking and checked
    after opening: a file swapped for a FIFO after it was listed would otherwise hang the read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        return b"", ("vanished before it could be read" if isinstance(exc, FileNotFoundError)
                     else f"unreadable ({exc.strerror})")
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b"", _not_regular(path)
        try:
            return f.read(limit), None
        except OSError as exc:
            return b"", f"unreadable ({exc.strerror})"


def _binary_reason(head: bytes) -> str | None:
    if b"\x00" in head:
        return "binary (contains NUL bytes)"
    head_text = head.decode("utf-8", errors="replace")
    invalid_in_head = head_text.count(REPLACEMENT) - head.count(REPLACEMENT_UTF8)
    if head and invalid_in_head / len(head) > BINARY_INVALID_SHARE:
        return "binary (mostly not UTF-8)"
    return None


def _load_structured(path: Path, data: DataConfig, cache_dir: Path, skipped: list[str]) -> list[str]:
    """Records of a structured file. One that cannot be read is skipped like a text file; one that
    does not parse is an error naming the file (and for JSON the lines), since part of the data is broken."""
    if path.suffix.lower() == ".jsonl":
        return _load_jsonl(path, data, skipped)
    raw_head, why_not = _read_regular(path, limit=BINARY_SNIFF_BYTES)
    if why_not is None and path.suffix.lower() != ".parquet":
        why_not = _binary_reason(raw_head)
    if why_not:
        skipped.append(f"{path}: {why_not}")
        log.warning("skipping %s: %s", path, why_not)
        return []
    import datasets  # heavy; only when structured files are used

    builder = STRUCTURED_BUILDERS[path.suffix.lower()]
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=str(cache_dir))
    except Exception as exc:  # datasets raises many types for a malformed file
        raise DataError(f"{path} cannot be read as {path.suffix.lower()[1:]}: {_parse_problem(path, exc)}; "
                        "fix the file or remove it from data.source") from None
    return _text_column(ds, data, where=str(path))


def _parse_problem(path: Path, exc: BaseException) -> str:
    """One line: where a JSON file breaks (line and column), else the innermost cause's first line."""
    if path.suffix.lower() == ".json":
        try:
            json.loads(path.read_bytes())
        except json.JSONDecodeError as err:
            return f"{err.msg} at line {err.lineno}, column {err.colno}"
        except (OSError, ValueError):
            pass
    while exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__):
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _load_jsonl(path: Path, data: DataConfig, skipped: list[str]) -> list[str]:
    """JSON Lines read here, line by line, so a broken record is reported by its line number."""
    raw, why_not = _read_regular(path)
    if why_not is None:
        why_not = _binary_reason(raw[:BINARY_SNIFF_BYTES])
    if why_not:
        skipped.append(f"{path}: {why_not}")
        log.warning("skipping %s: %s", path, why_not)
        return []
    docs: list[str] = []
    broken: list[int] = []
    fields: dict[str, None] = {}  # every field seen, in order of appearance
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)  # bytes: invalid UTF-8 is a ValueError too
        except ValueError:
            broken.append(number)
            continue
        if not isinstance(record, dict):
            broken.append(number)
            continue
        fields.update(dict.fromkeys(record))
        value = record.get(data.text_field)
        if isinstance(value, str) and value.strip():
            docs.append(value)
    if broken:
        shown = ", ".join(map(str, broken[:10])) + (f" and {len(broken) - 10} more" if len(broken) > 10 else "")
        what = (f"lines {shown} are not valid JSON objects" if len(broken) > 1
                else f"line {shown} is not a valid JSON object")
        raise DataError(f"{path}: {what}; fix or remove them (each line must hold one JSON object)")
    if fields and data.text_field not in fields:
        raise DataError(
            f"{path} has no field {data.text_field!r}; its fields are: {', '.join(fields)}; set data.text_field"
        )
    return docs


def _load_hub(data: DataConfig, cache_dir: Path) -> Corpus:
    import datasets

    dataset_id = data.source[len(HUB_PREFIX):]
    if not dataset_id:
        raise DataError(f"data.source: {data.source!r} names no dataset; use '{HUB_PREFIX}<owner>/<name>'")
    streaming = data.max_docs is not None  # read only what the cap needs instead of the whole dataset
    revision = hub_revision(data)
    try:
        ds = datasets.load_dataset(dataset_id, name=data.hf_subset, split=data.hf_split, streaming=streaming,
                                   cache_dir=str(cache_dir), revision=revision or data.hf_revision)
        if streaming:
            ds = ds.take(data.max_docs)
        docs = _text_column(ds, data, where=f"dataset {dataset_id!r}")
    except DataError:
        raise
    except Exception as exc:
        offline = _env_on("HF_DATASETS_OFFLINE") or _env_on("HF_HUB_OFFLINE")
        hint = " (offline mode is on: only datasets already in the cache can load)" if offline else (
            " (a hub dataset needs network access; check the id, data.hf_subset and data.hf_split)"
        )
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"could not load {data.source!r}: {first_line}{hint}") from None
    corpus = Corpus(
        docs=docs, kind="hub", source=dataset_id, fingerprint=source_fingerprint(data),
        hub_fingerprint=getattr(ds, "_fingerprint", None), revision=revision,
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


def stage_extra_key(cfg: Config) -> dict[str, str | None]:
    """What besides the config determines the tokenize stage's output: the source's content and a
    given tokenizer file. Here, not in tasks/stages/tokenize.py, so that planning needs no heavy import."""
    tok_hash = None  # the tokenize stage's extra key
    if cfg.tokenizer.path:
        tok_path = Path(cfg.tokenizer.path).expanduser()
        tok_hash = hashlib.sha256(tok_path.read_bytes()).hexdigest() if tok_path.is_file() else "missing"
    return {"source": source_fingerprint(cfg.data), "tokenizer_file": tok_hash}
