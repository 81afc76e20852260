"""The tokenize stage as a plain function: sources, split, shards, bad input. No Prefect here."""

import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tokenizers import Tokenizer

from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.data.corpus import list_source_files, load_corpus, stage_extra_key, stdlib_root
from cpuforge.tasks.data.encoding import decode_shard, shard_dtype
from cpuforge.tasks.records.errors import ConfigError, DataError
from cpuforge.tasks.stages.tokenize import (
    chunk_documents,
    split_documents,
    tokenize,
    train_tokenizer,
)
from tests.conftest import corpus_bytes, make_text


def cfg_for(source, *extra):
    return load_config("tiny", overrides=[f"data.source={source}", "data.max_docs=null", *extra])


def run_tokenize(tmp_path: Path, source, *extra):
    out = tmp_path / "out"
    out.mkdir()
    cfg = cfg_for(source, *extra)
    output = tokenize(cfg.data, cfg.tokenizer, out, tmp_path / "cache")
    meta = json.loads((out / "meta.json").read_text())
    return out, output, meta


def shard_docs(out: Path, meta: dict) -> list[str]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    docs = []
    for split in ("train", "val"):
        docs += decode_shard(tok, out / f"{split}.bin", np.dtype(meta["dtype"]), meta["eod_id"])
    return docs


def test_folder_of_text_files_round_trips_exactly(tmp_path, text_corpus):
    out, output, meta = run_tokenize(tmp_path, text_corpus)
    # Bytes add up to the corpus, CRLF and non-ASCII included.
    assert meta["splits"]["train"]["bytes"] + meta["splits"]["val"]["bytes"] == corpus_bytes(text_corpus)
    originals = sorted(p.read_bytes().decode() for p in text_corpus.rglob("*") if p.is_file())
    assert sorted(shard_docs(out, meta)) == originals
    # A small corpus may run out of pairs frequent enough to merge before reaching the target.
    assert meta["dtype"] == "uint16" and 300 < meta["vocab_size"] <= 512
    for split in ("train", "val"):
        ids = np.memmap(out / f"{split}.bin", dtype=np.uint16, mode="r")
        assert len(ids) == meta["splits"][split]["tokens"] == output.metrics[f"tokens_{split}"]
        assert ids[-1] == meta["eod_id"]
        assert (ids == meta["eod_id"]).sum() == meta["splits"][split]["docs"]
    assert output.metrics["docs_val"] >= 1 and output.metrics["tokens_per_s"] > 0


def test_special_token_spelling_inside_text_stays_text(tmp_path):
    corpus = tmp_path / "c"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text(make_text(i) + "literal <|endoftext|> in the middle\n")
    out, _, meta = run_tokenize(tmp_path, corpus, "data.min_docs=2")
    docs = shard_docs(out, meta)
    assert len(docs) == meta["splits"]["train"]["docs"] + meta["splits"]["val"]["docs"] == 6
    assert all("literal <|endoftext|> in the middle" in d for d in docs)


def test_one_big_file_is_cut_into_documents_and_split(tmp_path):
    big = tmp_path / "one.txt"
    text = "".join(make_text(i) for i in range(40))
    big.write_text(text)
    out, _, meta = run_tokenize(tmp_path, big)
    assert meta["splits"]["val"]["docs"] >= 1 and meta["splits"]["train"]["docs"] >= 10
    assert meta["splits"]["train"]["bytes"] + meta["splits"]["val"]["bytes"] == len(text.encode())


def test_chunks_concatenate_back_to_the_document():
    doc = "".join(make_text(i) for i in range(10))
    chunks = chunk_documents([doc], chunk_bytes=2048, min_docs=2)
    assert len(chunks) > 3 and "".join(chunks) == doc
    assert all(c.endswith("\n") for c in chunks)


def test_split_is_deterministic_and_stable_when_documents_are_added():
    docs = [make_text(i, 5) for i in range(200)]
    train, val = split_documents(docs, 0.1, seed=0)
    assert (train, val) == split_documents(docs, 0.1, seed=0)
    assert 5 <= len(val) <= 40 and sorted(train + val) == list(range(200))
    assert split_documents(docs, 0.1, seed=1)[1] != val
    val_texts = {docs[i] for i in val}
    more = docs + [make_text(1000 + i, 5) for i in range(50)]
    _, val2 = split_documents(more, 0.1, seed=0)
    assert val_texts <= {more[i] for i in val2}  # nothing moved across the split
    reordered = list(reversed(docs))
    assert {reordered[i] for i in split_documents(reordered, 0.1, seed=0)[1]} == val_texts


def test_split_always_has_both_sides_and_rejects_a_single_document():
    docs = [make_text(i, 3) for i in range(3)]
    train, val = split_documents(docs, 0.01, seed=0)
    assert len(val) == 1 and len(train) == 2
    with pytest.raises(DataError, match="at least 2"):
        split_documents(["only one"], 0.1, seed=0)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_structured_files_use_the_text_field(tmp_path, suffix):
    import pandas as pd

    rows = pd.DataFrame({"id": range(30), "body": [make_text(i, 8) for i in range(30)]})
    path = tmp_path / f"data{suffix}"
    {".jsonl": lambda: rows.to_json(path, orient="records", lines=True),
     ".json": lambda: rows.to_json(path, orient="records"),
     ".csv": lambda: rows.to_csv(path, index=False),
     ".parquet": lambda: rows.to_parquet(path)}[suffix]()
    out, output, meta = run_tokenize(tmp_path, path, "data.text_field=body")
    assert output.metrics["docs_train"] + output.metrics["docs_val"] == 30
    assert sorted(shard_docs(out, meta)) == sorted(rows["body"])
    with pytest.raises(DataError, match="has no field 'text'; its fields are: id, body; set data.text_field"):
        run_tokenize(tmp_path / "x", path) if (tmp_path / "x").mkdir() is None else None


def test_hub_dataset_path_with_split_and_document_cap(tmp_path):
    """The hub loader, exercised on a dataset repository laid out on disk (never the network)."""
    import pandas as pd

    repo = tmp_path / "hub_repo"
    (repo / "data").mkdir(parents=True)
    pd.DataFrame({"text": [make_text(i, 6) for i in range(40)]}).to_parquet(repo / "data" / "train-00000-of-00001.parquet")
    pd.DataFrame({"text": [make_text(100 + i, 6) for i in range(10)]}).to_parquet(repo / "data" / "test-00000-of-00001.parquet")
    _, output, meta = run_tokenize(tmp_path, f"hf:{repo}", "data.hf_split=test", "data.min_docs=2")
    assert output.metrics["docs_train"] + output.metrics["docs_val"] == 10
    assert meta["source"]["kind"] == "hub"
    (tmp_path / "capped").mkdir()
    _, capped, _ = run_tokenize(tmp_path / "capped", f"hf:{repo}", "data.max_docs=25", "data.min_docs=2")
    assert capped.metrics["docs_train"] + capped.metrics["docs_val"] == 25
    (tmp_path / "missing").mkdir()
    with pytest.raises(DataError, match="could not load 'hf:no-such/dataset'"):
        run_tokenize(tmp_path / "missing", "hf:no-such/dataset")


def test_embedded_stdlib_corpus_excludes_site_packages_and_tests():
    cfg = load_config("tiny")
    files, _ = list_source_files(cfg.data)
    root = stdlib_root()
    assert len(files) == cfg.data.max_docs
    assert all(p.suffix == ".py" and root in p.parents for p in files)
    assert not any({"site-packages", "test", "tests", "encodings"} & set(p.relative_to(root).parts) for p in files)
    everything, _ = list_source_files(load_config("demo").data)
    assert len(everything) > 500


def test_binary_file_among_text_is_skipped_with_a_warning(tmp_path, text_corpus, caplog):
    (text_corpus / "blob.txt").write_bytes(bytes(range(256)) * 20)
    (text_corpus / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    with caplog.at_level(logging.WARNING, logger="cpuforge"):
        _, output, meta = run_tokenize(tmp_path, text_corpus)
    assert "blob.txt" in caplog.text and "binary" in caplog.text
    assert output.metrics["skipped_files"] == 2
    assert any("image.png: unsupported file type" in s for s in meta["skipped"])
    assert meta["splits"]["train"]["bytes"] + meta["splits"]["val"]["bytes"] == corpus_bytes(text_corpus) - 5120


def test_invalid_utf8_is_replaced_counted_and_warned(tmp_path, text_corpus, caplog):
    (text_corpus / "latin1.txt").write_bytes(make_text(7).encode() + "café crème\n".encode("latin-1"))
    with caplog.at_level(logging.WARNING, logger="cpuforge"):
        _, output, _ = run_tokenize(tmp_path, text_corpus)
    assert output.metrics["replaced_sequences"] == 2
    assert "latin1.txt: replaced 2 invalid UTF-8" in caplog.text


def _files(**contents: bytes):
    def make(folder: Path) -> Path:
        for name, data in contents.items():
            (folder / name.replace("_", ".")).write_bytes(data)
        return folder
    return make


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "missing", "no such file or folder"),
        (lambda d: d / "*.nothing", "matches no files"),
        (_files(a_txt=b"", b_md=b" \n"), "is empty"),
        (_files(a_txt=b"\0\1\2" * 100), "no decodable text"),
        (_files(a_bin=b"\0" * 10), "no .txt/.md/.py"),
    ],
    ids=["missing-path", "empty-glob", "empty-files", "binary-only", "no-supported-files"],
)
def test_unusable_corpora_fail_clearly_and_leave_nothing_finished(tmp_path, make, message):
    source_dir = tmp_path / "src"
    source_dir.mkdir()
    source = make(source_dir)
    with pytest.raises(DataError, match=message):
        cfg = cfg_for(source)
        stage_extra_key(cfg)  # the CLI's pre-flight check
        run_tokenize(tmp_path, source)
    assert not (tmp_path / "out" / "meta.json").exists()


def test_vocab_smaller_than_byte_alphabet_is_a_config_error():
    with pytest.raises(ConfigError, match="smaller than the byte alphabet"):
        load_config("tiny", overrides=["tokenizer.vocab_size=256"])


def test_existing_tokenizer_by_path(tmp_path, text_corpus):
    corpus = load_corpus(cfg_for(text_corpus).data, tmp_path)
    tok = train_tokenizer(corpus.docs, cfg_for(text_corpus, "tokenizer.vocab_size=300").tokenizer)
    tok.save(str(tmp_path / "given.json"))
    _, output, meta = run_tokenize(tmp_path, text_corpus, f"tokenizer.path={tmp_path / 'given.json'}")
    assert output.metrics["vocab_size"] == 300 and meta["tokenizer"]["trained"] is False
    tok_no_eod = train_tokenizer(corpus.docs, cfg_for(text_corpus, "tokenizer.eod_token=<eos>").tokenizer)
    tok_no_eod.save(str(tmp_path / "other.json"))
    (tmp_path / "o2").mkdir()
    with pytest.raises(DataError, match="has no '<\\|endoftext\\|>' token"):
        run_tokenize(tmp_path / "o2", text_corpus, f"tokenizer.path={tmp_path / 'other.json'}")


def test_shards_switch_to_uint32_past_65536_tokens():
    assert shard_dtype(65536) == np.uint16 and shard_dtype(65537) == np.uint32


def test_encoding_in_parallel_on_a_process_pool_or_dask_writes_the_same_shards(tmp_path, text_corpus, prefect_server):
    outputs = {}
    for runner in ("single", "process", "dask", "auto"):
        out = tmp_path / runner
        out.mkdir()
        cfg = load_config("tiny", overrides=[f"data.source={text_corpus}", f"data.encode_runner={runner}",
                                             "data.piece_bytes=4096", "data.encode_workers=2"])
        outputs[runner] = (out, tokenize(cfg.data, cfg.tokenizer, out, tmp_path / "cache"))
    single, _ = outputs["single"]
    for runner in ("process", "dask", "auto"):
        out, result = outputs[runner]
        for name in ("train.bin", "val.bin", "tokenizer.json"):
            assert (out / name).read_bytes() == (single / name).read_bytes(), (runner, name)
        assert json.loads((out / "meta.json").read_text())["splits"] == json.loads((single / "meta.json").read_text())["splits"]
        assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    assert os.path.getsize(single / "train.bin") > 4 * 4096  # several pieces were really made


def test_encode_runner_auto_takes_one_process_where_a_pool_is_not_faster(monkeypatch):
    import cpuforge.tasks.data.parallel_encode as parallel_encode
    from cpuforge.tasks.config.settings import DataConfig

    assert DataConfig().encode_runner == "auto"
    monkeypatch.setattr(parallel_encode, "available_cores", lambda: 2)
    kind, why = parallel_encode.choose_runner(DataConfig())
    assert kind == "single" and "2 worker" in why
    assert parallel_encode.choose_runner(DataConfig(encode_runner="process"))[0] == "process"  # asked for: kept
    monkeypatch.setattr(parallel_encode, "available_cores", lambda: 8)
    assert parallel_encode.choose_runner(DataConfig())[0] == "process"
    assert parallel_encode.choose_runner(DataConfig(encode_workers=2))[0] == "single"
    assert parallel_encode.choose_runner(DataConfig(dask_address="tcp://127.0.0.1:8786"))[0] == "dask"


def test_sample_prompts_are_the_corpus_own_opening_words_and_short(tmp_path):
    """evaluate's default prompts: the opening words of validation documents, cut to a few tokens even where a
    document opens with one long 'word' (a banner, a URL), so a prompt always fits the context."""
    from cpuforge.tasks.engine.data import corpus_prompts, open_shards

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(30):
        opening = "#" * 300 if i % 2 else f"Chapter {i} begins here"
        (corpus / f"{i:02d}.txt").write_text(f"{opening}\n" + make_text(i, 20))
    out, _, _ = run_tokenize(tmp_path, corpus, "data.val_fraction=0.3")
    shards = open_shards(out, 0)
    prompts = corpus_prompts(shards, max_tokens=16)
    tokenizer = Tokenizer.from_file(str(shards.tokenizer_path))
    assert prompts and all(p.strip() for p in prompts)
    assert all(len(tokenizer.encode(p).ids) <= 16 for p in prompts)
    assert all(p.startswith("Chapter ") or set(p) == {"#"} for p in prompts)


def test_a_hub_dataset_is_read_at_the_commit_its_revision_names_now(tmp_path, monkeypatch):
    """Each run asks the hub which commit the revision (default branch, or data.hf_revision) names, reads that
    commit and records it; a new commit changes the tokenize key (re-tokenize), the same one keeps it (reuse).
    The hub is simulated: dataset_info answers a commit, and load_dataset reads a repository on disk."""
    import datasets
    import huggingface_hub
    import pandas as pd

    from cpuforge.tasks.data import corpus

    repo = tmp_path / "hub_repo" / "data"
    repo.mkdir(parents=True)
    pd.DataFrame({"text": [make_text(i, 6) for i in range(20)]}).to_parquet(repo / "train-00000-of-00001.parquet")
    head = {"sha": "a" * 40}
    asked, read = [], []
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info",
                        lambda self, repo_id, revision=None, **kw: asked.append((repo_id, revision))
                        or SimpleNamespace(sha=head["sha"]))
    real_load = datasets.load_dataset

    def load_dataset(path, *args, revision=None, **kw):
        read.append((path, revision))
        return real_load(str(repo.parent), *args, **kw)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the tests' offline default; nothing here goes out
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    corpus._resolve_revision.cache_clear()
    _, output, meta = run_tokenize(tmp_path, "hf:someone/code", "data.min_docs=2")
    assert meta["source"]["revision"] == "a" * 40 and output.dataset["revision"] == "a" * 40
    assert read == [("someone/code", "a" * 40)] and asked == [("someone/code", None)]
    cfg = cfg_for("hf:someone/code")
    same = stage_extra_key(cfg)
    corpus._resolve_revision.cache_clear()  # a later run: the hub is asked again
    assert stage_extra_key(cfg) == same
    head["sha"] = "b" * 40  # a new commit on the default branch: new data
    corpus._resolve_revision.cache_clear()
    assert stage_extra_key(cfg) != same
    corpus._resolve_revision.cache_clear()
    pinned = cfg_for("hf:someone/code", "data.hf_revision=v1.0")
    stage_extra_key(pinned)
    assert asked[-1] == ("someone/code", "v1.0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: a commit pin still names the data, nothing is asked
    n = len(asked)
    assert corpus.hub_revision(cfg_for("hf:someone/code", f"data.hf_revision={'c' * 40}").data) == "c" * 40
    assert len(asked) == n
