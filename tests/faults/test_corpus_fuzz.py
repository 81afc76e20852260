"""The corpus reader against hostile folders: every file either becomes text, is skipped with a one-line
warning (and counted), or stops the run with one DataError line that says what to fix. Never another
exception, never a hang (FIFOs, symlink loops), whatever the bytes."""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

import pytest

import cpuforge.tasks.data.corpus as corpus_module
from cpuforge.flows.cli import main
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.data.corpus import load_corpus, stage_extra_key
from cpuforge.tasks.records.errors import DataError
from tests.conftest import as_unprivileged, make_text


def load(source: Path, cache: Path):
    """What the pipeline does with a source: the CLI's pre-flight check, then the tokenize stage's read."""
    cfg = load_config("tiny", overrides=[f"data.source={source}", "data.max_docs=null"])
    stage_extra_key(cfg)
    return load_corpus(cfg.data, cache)


@pytest.fixture
def folder(tmp_path) -> Path:
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(3):
        (root / f"good{i}.txt").write_text(make_text(i), encoding="utf-8")
    return root


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("name, make, reason", [
    ("random.txt", lambda p: p.write_bytes(random.Random(1).randbytes(50_000)), "binary (contains NUL bytes)"),
    ("nul.md", lambda p: p.write_bytes(b"text with a NUL\x00 inside\n" * 10), "binary (contains NUL bytes)"),
    ("fifo.txt", lambda p: os.mkfifo(p), "not a regular file (a FIFO)"),
    ("loop.txt", lambda p: p.symlink_to(p), "a symlink that leads nowhere (Too many levels of symbolic links)"),
    ("dangling.py", lambda p: p.symlink_to(p.parent / "nowhere"),
     "a symlink that leads nowhere (No such file or directory)"),
    ("binary.jsonl", lambda p: p.write_bytes(b"\x00\x01" * 4000), "binary (contains NUL bytes)"),
    ("binary.csv", lambda p: p.write_bytes(random.Random(2).randbytes(5000) + b"\x00"), "binary (contains NUL bytes)"),
])
def test_unusable_file_is_skipped_with_one_warning(folder, tmp_path, caplog, name, make, reason):
    make(folder / name)
    with caplog.at_level(logging.WARNING, logger="cpuforge"):
        corpus = load(folder, tmp_path / "cache")
    assert len(corpus.docs) == 3
    assert corpus.skipped == [f"{folder / name}: {reason}"]
    warned = [w for w in warnings_of(caplog) if name in w]
    assert len(warned) == 1 and reason in warned[0] and "\n" not in warned[0]


def test_symlink_loop_of_folders_is_not_followed(folder, tmp_path):
    (folder / "sub").mkdir()
    (folder / "sub" / "up").symlink_to(folder)
    (folder / "self").symlink_to(".")
    corpus = load(folder, tmp_path / "cache")
    assert len(corpus.docs) == 3 and corpus.skipped == []


def test_huge_single_line_and_mixed_encodings_are_read(folder, tmp_path, caplog):
    (folder / "huge.txt").write_bytes(b"x" * (24 * 2**20))  # 24 MB, no newline
    (folder / "mixed.txt").write_bytes("UTF-8 café, ".encode() + "latin-1 café\n".encode("latin-1"))
    with caplog.at_level(logging.WARNING, logger="cpuforge"):
        corpus = load(folder, tmp_path / "cache")
    assert sorted(len(d) for d in corpus.docs)[-1] == 24 * 2**20
    assert corpus.replaced_sequences == 1
    assert any("mixed.txt: replaced 1 invalid UTF-8 sequence" in w for w in warnings_of(caplog))


def test_file_that_vanishes_between_listing_and_reading(folder, tmp_path, monkeypatch, caplog):
    cfg = load_config("tiny", overrides=[f"data.source={folder}", "data.max_docs=null"])
    stage_extra_key(cfg)  # the pre-flight check sees the file
    listed = corpus_module.list_source_files

    def list_then_delete(data):
        files, skipped = listed(data)
        (folder / "good1.txt").unlink(missing_ok=True)  # the race, made certain
        return files, skipped

    monkeypatch.setattr(corpus_module, "list_source_files", list_then_delete)
    with caplog.at_level(logging.WARNING, logger="cpuforge"):
        corpus = load_corpus(cfg.data, tmp_path / "cache")
    assert len(corpus.docs) == 2
    assert corpus.skipped == [f"{folder / 'good1.txt'}: vanished before it could be read"]
    assert any("good1.txt: vanished" in w for w in warnings_of(caplog))


def _read_as_nobody(source: str, report: str) -> int:
    try:
        corpus = load(Path(source), Path(report).parent / "cache")
        result = {"docs": len(corpus.docs), "skipped": corpus.skipped}
    except DataError as exc:
        result = {"error": str(exc)}
    Path(report).write_text(json.dumps(result))
    return 0


def test_unreadable_files_are_skipped_for_an_unprivileged_user(shared_tmp):
    shared = shared_tmp
    root = shared / "corpus"
    root.mkdir()
    (root / "good.txt").write_text(make_text(1))
    (root / "secret.txt").write_text(make_text(2))
    (root / "secret.txt").chmod(0o000)
    (root / "locked.jsonl").write_text('{"text": "x"}\n')
    (root / "locked.jsonl").chmod(0o000)
    (root / "private").mkdir()
    (root / "private" / "hidden.txt").write_text(make_text(3))
    (root / "private").chmod(0o000)
    code, err = as_unprivileged(_read_as_nobody, str(root), str(shared / "report.json"))
    assert code == 0, err
    result = json.loads((shared / "report.json").read_text())
    assert result == {"docs": 1, "skipped": [f"{root / 'locked.jsonl'}: unreadable (Permission denied)",
                                             f"{root / 'secret.txt'}: unreadable (Permission denied)"]}


@pytest.mark.parametrize("name, content, message", [
    ("data.jsonl", b'{"text": "ok"}\n{"text": broken}\n{"text": "ok"}\n[1, 2]\n',
     "data.jsonl: lines 2, 4 are not valid JSON objects; fix or remove them"),
    ("data.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "data.jsonl: line 2 is not a valid JSON object"),
    ("huge.jsonl", b'{"text": "' + b"y" * (8 * 2**20) + b'"\n', "huge.jsonl: line 1 is not a valid JSON object"),
    ("data.json", b'[{"text": "ok"},\n {"text": "no end"\n', "data.json cannot be read as json: "
                                                               "Expecting ',' delimiter at line 3, column 1"),
    ("data.parquet", b"PAR1 this is not parquet at all", "data.parquet cannot be read as parquet: "),
    ("data.csv", b'id,text\n1,hello\n2,"unterminated\n', "data.csv cannot be read as csv: Error tokenizing data. "
                                                         "C error: EOF inside string starting at row 2"),
])
def test_structured_file_that_does_not_parse_is_one_error_naming_file_and_line(folder, tmp_path, name, content,
                                                                                message):
    (folder / name).write_bytes(content)
    with pytest.raises(DataError) as err:
        load(folder, tmp_path / "cache")
    assert message in str(err.value) and "\n" not in str(err.value) and str(folder / name) in str(err.value)


def test_only_binary_files_is_an_error_saying_so(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_bytes(random.Random(3).randbytes(10_000))
    (root / "b.md").write_bytes(b"\x00" * 100)
    with pytest.raises(DataError, match=r"no decodable text in .*: every file was skipped \(.*a.txt: binary"):
        load(root, tmp_path / "cache")


CONTENTS = [
    lambda rng: make_text(rng.randrange(1000)).encode(),
    lambda rng: rng.randbytes(rng.randrange(1, 20_000)),
    lambda rng: make_text(rng.randrange(1000)).encode() + b"\x00" + rng.randbytes(100),
    lambda rng: make_text(rng.randrange(1000)).encode("utf-16"),
    lambda rng: bytes(rng.choice(b"\xe9\xff\xc3\x80abc \n") for _ in range(rng.randrange(1, 3000))),
    lambda rng: b"",
    lambda rng: b"\n".join(json.dumps({"text": make_text(rng.randrange(100), 2)}).encode()
                           for _ in range(rng.randrange(1, 5))),
]


@pytest.mark.parametrize("seed", range(12))
def test_random_folders_give_text_or_one_line_data_error(tmp_path, seed):
    """The fuzzer: random mixes of text, noise, NULs, UTF-16, latin-1, empty files, FIFOs and loops."""
    rng = random.Random(seed)
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(rng.randrange(1, 9)):
        path = root / f"f{i}{rng.choice(['.txt', '.md', '.py', '.jsonl', '.bin'])}"
        kind = rng.randrange(len(CONTENTS) + 2)
        if kind == len(CONTENTS):
            os.mkfifo(path)
        elif kind == len(CONTENTS) + 1:
            path.symlink_to(path)
        else:
            path.write_bytes(CONTENTS[kind](rng))
    try:
        corpus = load(root, tmp_path / "cache")
    except DataError as exc:
        assert "\n" not in str(exc) and str(exc)
    else:
        assert corpus.docs and all(isinstance(d, str) and d.strip() for d in corpus.docs)


def test_cli_reports_a_corpus_of_special_files_in_one_line(tmp_path, capsys):
    """End to end: the pre-flight check of `cpuforge run` lists the corpus before any work starts."""
    root = tmp_path / "corpus"
    root.mkdir()
    os.mkfifo(root / "pipe.txt")
    (root / "loop.md").symlink_to(root / "loop.md")
    code = main(["run", "--profile", "tiny", "--workdir", str(tmp_path / "w"), "--set", f"data.source={root}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines == [f"error: data.source: no .txt/.md/.py/.jsonl/.json/.csv/.parquet files in '{root}' "
                     "(2 other files skipped)"]
