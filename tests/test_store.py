import logging
import threading
import time
from pathlib import Path

import pytest

from cpuforge.tasks.infra.store import StageRecord, StageStore, stage_key


def test_key_changes_with_anything_that_determines_output():
    base = dict(stage="tokenize", version="1", config={"data": {"a": 1}}, inputs={}, extra={"source": "x"})
    key = stage_key(**base)
    assert key == stage_key(**base)
    assert key != stage_key(**{**base, "version": "2"})
    assert key != stage_key(**{**base, "config": {"data": {"a": 2}}})
    assert key != stage_key(**{**base, "inputs": {"tokenize": "abc"}})
    assert key != stage_key(**{**base, "extra": {"source": "y"}})


def test_a_stage_is_visible_only_once_committed(tmp_path: Path):
    store = StageStore(tmp_path)
    key = "a" * 64
    with store.building("tokenize", key) as partial:
        (partial / "train.bin").write_bytes(b"\0\0")
        assert store.lookup("tokenize", key) is None  # half-written: not finished
        record = store.commit(partial, StageRecord(stage="tokenize", key=key, output_dir=str(partial),
                                                   metrics={"tokens": 1}, files={"train": "train.bin"}))
    assert not partial.exists()
    found = store.lookup("tokenize", key)
    assert found is not None and found.metrics == {"tokens": 1}
    assert found.path("train").read_bytes() == b"\0\0"
    assert Path(record.output_dir).name == f"tokenize-{key[:16]}"


def test_a_crashed_build_leaves_only_a_partial_folder(tmp_path: Path):
    store = StageStore(tmp_path)
    with pytest.raises(RuntimeError):
        with store.building("tokenize", "b" * 64) as partial:
            (partial / "half").write_text("x")
            raise RuntimeError("crash")
    assert store.lookup("tokenize", "b" * 64) is None
    assert partial.exists() and partial.name.endswith(".partial")


def test_a_corrupted_record_is_not_reused(tmp_path: Path):
    store = StageStore(tmp_path)
    folder = store.final_dir("tokenize", "c" * 64)
    folder.mkdir(parents=True)
    (folder / "record.json").write_text('{"stage": "tokenize", "ke')
    assert store.lookup("tokenize", "c" * 64) is None


def test_a_second_builder_of_the_same_stage_waits_and_then_finds_it_built(tmp_path: Path, caplog):
    store = StageStore(tmp_path)
    key = "d" * 64
    first_has_lock = threading.Event()

    def first_builder():
        with store.building("tokenize", key) as partial:
            first_has_lock.set()
            time.sleep(1.5)
            store.commit(partial, StageRecord(stage="tokenize", key=key, output_dir=str(partial)))

    thread = threading.Thread(target=first_builder)
    thread.start()
    first_has_lock.wait()
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="cpuforge.locks"), store.building("tokenize", key) as partial:
        waited = time.monotonic() - started
    thread.join()
    assert waited >= 1.0 and partial is None  # it waited, then found the first builder's output: nothing to build
    assert store.lookup("tokenize", key) is not None and not list(tmp_path.glob("stages/*.partial"))
    assert "which another cpuforge run is building" in caplog.text and "building tokenize-" in caplog.text


def test_an_interrupted_attempt_is_cleared_unless_the_stage_resumes(tmp_path: Path):
    store = StageStore(tmp_path)
    for resumable in (False, True):
        key = ("e" if resumable else "f") * 64
        with store.building("quantize", key, resumable=resumable) as partial:
            (partial / "candidates").mkdir()  # an attempt killed halfway
        with store.building("quantize", key, resumable=resumable) as partial:
            assert (partial / "candidates").exists() == resumable


def test_a_setting_changes_the_config_of_only_the_stages_that_read_it():
    """Which stages a changed setting re-runs (later stages follow through their inputs' keys)."""
    from cpuforge.tasks import stages
    from cpuforge.tasks.config.settings import load_config
    from cpuforge.tasks.infra.stage import stage_config

    specs = {spec.name: spec for spec in stages.PIPELINE}
    base = load_config("tiny")

    def changed(*overrides: str) -> set[str]:
        cfg = load_config("tiny", overrides=list(overrides))
        return {name for name, spec in specs.items() if stage_config(cfg, spec) != stage_config(base, spec)}

    assert changed("model.n_layer=3") == {"pretrain"}
    assert changed("prune.keep_ratio=0.6") == {"prune"}
    assert changed("tokenizer.vocab_size=400") == {"tokenize"}
    assert changed("train.lr=0.001") == {"pretrain", "recover"}  # recovery trains with the train section too
    assert changed("quantize.method=static") == {"quantize"}
    assert changed("eval.max_tokens=2048") == {"evaluate"}
    # Settings that only say where an input comes from or how it is computed re-run nothing by
    # themselves: the resolved input (weights, tokenizer file, shards: the same bytes) keys the stage.
    assert changed("data.encode_runner=dask", "data.piece_bytes=4096", "data.encode_workers=2") == set()
    assert changed("train.init_from=champion", "tokenizer.path=/elsewhere/tokenizer.json") == set()
