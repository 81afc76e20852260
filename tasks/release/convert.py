"""`cpuforge export` and `cpuforge quantize` on a model of one's own, without the pipeline (as optimum-cli and
llama.cpp's tools work on a folder): the export and quantize stages' own code, handed the folder and token
shards made from a text file the user gives. Export proves its graph on windows of that text (or, with none,
of random token ids: the logits and greedy check does not need real text); quantize scores and calibrates on
it, so it needs text.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from cpuforge.models.checkpoint import CheckpointError, load_model, save_model
from cpuforge.models.config import LlamaConfig
from cpuforge.models.hf_format import write_tokenizer
from cpuforge.models.onnx_export import META_CONFIG, META_EOD, read_metadata
from cpuforge.models.onnx_layout import GENAI_CONFIG, TOKENIZER
from cpuforge.tasks.config.settings import ExportConfig, QuantizeConfig
from cpuforge.tasks.data.encoding import encode_to_array, shard_dtype
from cpuforge.tasks.infra.stage import StageOutput
from cpuforge.tasks.infra.store import StageRecord
from cpuforge.tasks.records.errors import DataError, ModelError, UserError
from cpuforge.tasks.release.lineage import check_hf_checkpoint
from cpuforge.tasks.stages.export import export_model
from cpuforge.tasks.stages.quantize import quantize_model

log = logging.getLogger("cpuforge.convert")

VAL_SHARE = 0.1  # of the text's tokens: the validation split (scoring, parity windows); the rest calibrates


def model_folder(path: Path, context: int | None, work: Path) -> tuple[Path, str]:
    """(a folder in transformers' layout that export can read, its end-of-document token) for a transformers or
    cpuforge model folder or a stage folder holding one in model/; cut to `context` positions where given (a copy
    in `work`)."""
    if not path.is_dir():
        raise UserError(f"{path}: no such folder (give a model folder with config.json, model.safetensors and "
                        "tokenizer.json)")
    folder = path / "model" if (path / "model" / "config.json").is_file() else path
    eod_token = check_hf_checkpoint(folder, str(path))
    if context is None:
        return folder, eod_token
    try:
        model = load_model(folder, max_context=context)
    except CheckpointError as exc:
        raise ModelError(f"{path}: {exc}") from None
    cut = work / "model"
    save_model(model, cut)
    eod_id = json.loads((folder / "config.json").read_text())["eos_token_id"]
    write_tokenizer(cut, folder / TOKENIZER, eod_token, eod_id[0] if isinstance(eod_id, list) else eod_id)
    return cut, eod_token


def token_shards(out: Path, tokenizer_json: Path, eod_token: str, block_size: int, text: Path | None) -> StageRecord:
    """train.bin, val.bin, meta.json and tokenizer.json in `out`, as the tokenize stage writes them: the text
    file's tokens (the last VAL_SHARE, at least one window, for validation), or random ids where there is no
    text. A record the stages read as the tokenize stage's."""
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    vocab, eod_id = tokenizer.get_vocab_size(), tokenizer.token_to_id(eod_token)
    dtype = shard_dtype(vocab)
    window = block_size + 2  # the fewest tokens a split may hold (data.open_shards)
    if text is None:
        ids = np.random.default_rng(0).integers(0, vocab, 8 * window).astype(dtype)
    else:
        if not text.is_file():
            raise UserError(f"--text {text}: no such file")
        try:
            content = text.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"--text {text}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        ids = encode_to_array(tokenizer, [content], eod_id, dtype)
        if len(ids) < 2 * window:
            raise DataError(f"--text {text}: {len(ids)} tokens, fewer than two windows of the model's {block_size} "
                            f"positions (+2) that validation and calibration need; give more text or a smaller "
                            "--context")
    n_val = min(len(ids) - window, max(window, int(VAL_SHARE * len(ids))))
    out.mkdir(parents=True, exist_ok=True)
    ids[:-n_val].tofile(out / "train.bin")
    ids[-n_val:].tofile(out / "val.bin")
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "meta.json").write_text(json.dumps({"vocab_size": vocab, "dtype": dtype.name, "eod_id": eod_id,
                                               "eod_token": eod_token, "text": str(text) if text else None}))
    log.info("%s: %d tokens for validation, %d for calibration", text or "random token ids", n_val, len(ids) - n_val)
    return StageRecord(stage="tokenize", key="standalone", output_dir=str(out))


def export_folder(path: Path, out_dir: Path, text: Path | None, context: int | None, opset: int | None,
                  work: Path) -> StageOutput:
    """The export stage on a model folder: out_dir gets model.onnx and the ONNX Runtime GenAI files, proven
    against PyTorch on windows of `text` (random ids without it)."""
    return export_resolved(*model_folder(path, context, work), out_dir, text, opset, work)


def export_resolved(folder: Path, eod_token: str, out_dir: Path, text: Path | None, opset: int | None,
                    work: Path) -> StageOutput:
    """export_folder on a folder model_folder already resolved (and cut)."""
    block_size = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
    tokenized = token_shards(work / "tokens", folder / TOKENIZER, eod_token, block_size, text)
    model = StageRecord(stage="recover", key="standalone", output_dir=str(folder.parent), files={"model": folder.name})
    e = ExportConfig() if opset is None else ExportConfig(opset=opset)
    out_dir.mkdir(parents=True, exist_ok=True)
    return export_model(e, tokenized, model, out_dir)


def quantize_path(path: Path, out_dir: Path, text: Path, context: int | None, q: QuantizeConfig,
                  work: Path) -> StageOutput:
    """The quantize stage on an exported ONNX model (a model.onnx, or the folder holding it) or on a model
    folder, exported first into out_dir/export: candidates scored and calibrated on `text`, the rule's choice
    kept as out_dir/model.int8.onnx."""
    onnx_file = path if path.suffix == ".onnx" else path / "model.onnx"
    hf_folder = None
    out_dir.mkdir(parents=True, exist_ok=True)
    if onnx_file.is_file():
        if context is not None:
            raise UserError("--context applies to a model folder; an ONNX model keeps the context it was exported "
                            "with")
        folder = onnx_file.parent
        if not (folder / GENAI_CONFIG).is_file() or not (folder / TOKENIZER).is_file():
            raise UserError(f"{onnx_file}: no {GENAI_CONFIG} and {TOKENIZER} beside it (not a folder `cpuforge export` "
                            "wrote): quantize the model folder instead, or export it first")
        meta = read_metadata(onnx_file)
        if META_CONFIG not in meta:
            raise UserError(f"{onnx_file}: not a cpuforge decoder graph (no {META_CONFIG} metadata)")
        tokenizer_json = folder / TOKENIZER
        eod_token = Tokenizer.from_file(str(tokenizer_json)).id_to_token(int(meta[META_EOD]))
        block_size = LlamaConfig.from_dict(json.loads(meta[META_CONFIG])).block_size
        exported = StageRecord(stage="export", key="standalone", output_dir=str(folder), files={"onnx": onnx_file.name})
    else:
        if path.suffix == ".onnx" or not path.exists():
            raise UserError(f"{path}: no such ONNX file or model folder")
        hf_folder, eod_token = model_folder(path, context, work / "export")  # the builder's candidates need it
        export_resolved(hf_folder, eod_token, out_dir / "export", text, None, work / "export")
        onnx_file = out_dir / "export" / "model.onnx"
        exported = StageRecord(stage="export", key="standalone", output_dir=str(onnx_file.parent),
                               files={"onnx": onnx_file.name})
        tokenizer_json = hf_folder / TOKENIZER
        block_size = json.loads((hf_folder / "config.json").read_text())["max_position_embeddings"]
    tokenized = token_shards(work / "tokens", tokenizer_json, eod_token, block_size, text)
    return quantize_model(q, tokenized, exported, out_dir, hf_folder=hf_folder)
