"""`cpuforge export` and `cpuforge quantize` on a transformers Llama folder of one's own, through the CLI, without
the pipeline: the ONNX files they write load and generate, and bad input gets one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cpuforge.flows.cli import main
from cpuforge.models.runtime import generate, load_language_model
from cpuforge.tasks.stages.quantize import GENAI
from tests.test_hf_import import make_corpus, save_hf_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> tuple[Path, Path]:
    """(a trained transformers Llama folder with a 128-position context, one text file of the corpus it saw)."""
    root = tmp_path_factory.mktemp("convert")
    corpus = make_corpus(root / "corpus")
    text = root / "notes.txt"
    text.write_text("\n\n".join(p.read_text() for p in sorted(corpus.glob("*.txt"))))
    return save_hf_llama(root / "hf-llama", corpus), text


def run_json(capsys, argv: list[str]) -> dict:
    code = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    return json.loads(out)


def test_export_a_transformers_folder_cut_to_a_shorter_context(hf_llama, tmp_path, capsys):
    source, text = hf_llama
    out = tmp_path / "onnx"
    metrics = run_json(capsys, ["export", str(source), "--out", str(out), "--text", str(text), "--context", "64"])
    assert metrics["out"] == str(out)
    assert metrics["parity_max_abs_diff"] < 1e-3 and metrics["generation_match"] == 1.0
    genai = json.loads((out / "genai_config.json").read_text())
    assert genai["search"]["max_length"] == 64 and genai["model"]["context_length"] == 64
    lm = load_language_model(out)
    assert lm.cfg.block_size == 64
    prompt = lm.tokenizer.encode("The ").ids
    assert len(list(generate(lm.decoder, prompt, 8))) == 8
    assert (source / "config.json").is_file() and not (source / "model.onnx").exists()  # the source is untouched


def test_export_without_text_proves_the_graph_on_random_tokens(hf_llama, tmp_path, capsys):
    source, _ = hf_llama
    metrics = run_json(capsys, ["export", str(source), "--out", str(tmp_path / "onnx")])
    assert metrics["generation_match"] == 1.0
    assert load_language_model(tmp_path / "onnx").cfg.block_size == 128  # the model's own context


def test_quantize_an_exported_folder_then_a_model_folder(hf_llama, tmp_path, capsys):
    source, text = hf_llama
    run_json(capsys, ["export", str(source), "--out", str(tmp_path / "onnx"), "--context", "64"])
    metrics = run_json(capsys, ["quantize", str(tmp_path / "onnx"), "--text", str(text), "--method", "dynamic",
                                "--out", str(tmp_path / "int8")])
    kept = tmp_path / "int8" / "model.int8.onnx"
    assert kept.is_file() and kept.stat().st_size < (tmp_path / "onnx" / "model.onnx").stat().st_size
    assert metrics["val_bpb"] > 0 and metrics["int8_bytes"] < metrics["fp32_bytes"]
    lm = load_language_model(tmp_path / "int8")
    assert lm.path == kept and len(list(generate(lm.decoder, lm.tokenizer.encode("The ").ids, 4))) == 4

    # a model folder: exported into OUT/export first, and the GenAI builder's candidates made from the folder;
    # a build cap too short for a second candidate keeps the likeliest winner and lists the rest
    metrics = run_json(capsys, ["quantize", str(source), "--text", str(text), "--method", "genai", "--context", "64",
                                "--build-seconds", "0.01", "--out", str(tmp_path / "from-folder")])
    out = tmp_path / "from-folder"
    assert (out / "export" / "model.onnx").is_file() and (out / "model.int8.onnx").is_file()
    assert metrics["val_bpb"] > 0 and metrics["int8_bytes"] < metrics["fp32_bytes"]
    assert metrics["candidates_built"] == 1 and metrics["candidates_skipped"] == len(GENAI) - 1
    assert "genai-int8-b64/val_bpb" in metrics and "**genai-int4**, " in (out / "quantize_report.md").read_text()
    assert load_language_model(out).cfg.block_size == 64


def test_bad_input_gets_one_line(hf_llama, tmp_path, capsys):
    source, text = hf_llama
    short = tmp_path / "short.txt"
    short.write_text("too short to validate on")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("a file the user wants kept")

    def error_line(argv: list[str]) -> str:
        code = main(argv)
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and "Traceback" not in err and len(errors) == 1, err
        return errors[0]

    assert "no such file or folder" in error_line(["export", str(tmp_path / "missing")])
    assert "already holds files" in error_line(["export", str(source), "--out", str(full)])
    assert (full / "keep.txt").read_text() == "a file the user wants kept"
    assert "--text" in error_line(["export", str(source), "--out", str(tmp_path / "a"), "--text", str(tmp_path / "no")])
    assert "fewer than two windows" in error_line(["quantize", str(source), "--text", str(short),
                                                   "--out", str(tmp_path / "b")])
    assert "no such folder" in error_line(["export", str(text), "--out", str(tmp_path / "c")])  # a file, not a folder
    run_json(capsys, ["export", str(source), "--out", str(tmp_path / "onnx"), "--context", "32"])
    assert "--context applies to a model folder" in error_line(
        ["quantize", str(tmp_path / "onnx"), "--text", str(text), "--context", "16", "--out", str(tmp_path / "d")])
    with pytest.raises(SystemExit) as usage:  # argparse: the usage and one line
        main(["quantize", str(tmp_path / "onnx"), "--text", str(text), "--build-seconds", "0"])
    assert usage.value.code == 2 and "--build-seconds: 0 must be more than 0 seconds" in capsys.readouterr().err
    (tmp_path / "onnx" / "genai_config.json").unlink()
    assert "genai_config.json" in error_line(["quantize", str(tmp_path / "onnx" / "model.onnx"), "--text", str(text),
                                              "--out", str(tmp_path / "e")])


def test_a_model_over_protobufs_limit_keeps_its_weights_beside_the_graph(hf_llama, tmp_path, capsys, monkeypatch):
    """What a 500M+ parameter model does (protobuf cannot hold 2 GiB), on the tiny model with the threshold at 0:
    export, quantize, load, generate and register all carry the graph's external weights file."""
    import mlflow

    from cpuforge.models import onnx_files
    from cpuforge.models.runtime import ModelLoadError
    from cpuforge.tasks.infra import text_model

    monkeypatch.setattr(onnx_files, "EXTERNAL_ABOVE", 0)
    source, text = hf_llama
    metrics = run_json(capsys, ["export", str(source), "--out", str(tmp_path / "onnx"), "--context", "64"])
    graph, weights = tmp_path / "onnx" / "model.onnx", tmp_path / "onnx" / "model.onnx.data"
    assert weights.is_file() and weights.stat().st_size > graph.stat().st_size  # the graph holds the tokenizer
    assert metrics["file_bytes"] == graph.stat().st_size + weights.stat().st_size and metrics["generation_match"] == 1
    run_json(capsys, ["quantize", str(tmp_path / "onnx"), "--text", str(text), "--method", "dynamic",
                      "--out", str(tmp_path / "int8")])
    kept = tmp_path / "int8" / "model.int8.onnx"
    assert onnx_files.files_of(kept) == ["model.int8.onnx", "model.int8.onnx.data"]
    assert not (tmp_path / "int8" / "prepared.onnx.data").exists()  # the quantizers' working copy is gone
    lm = load_language_model(kept)
    assert lm.file_bytes == onnx_files.total_bytes(kept)
    greedy = list(generate(lm.decoder, lm.tokenizer.encode("The ").ids, 6))

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with mlflow.start_run():
        version = text_model.log_text_model(kept, tmp_path / "int8" / "tokenizer.json", "large-lm", metadata={})
    registered = load_language_model(text_model.download(f"models:/large-lm/{version}", tmp_path / "download"))
    assert list(generate(registered.decoder, registered.tokenizer.encode("The ").ids, 6)) == greedy

    (tmp_path / "int8" / "model.int8.onnx.data").rename(tmp_path / "moved.data")
    with pytest.raises(ModelLoadError, match="model.int8.onnx.data is not beside it"):
        load_language_model(kept)
