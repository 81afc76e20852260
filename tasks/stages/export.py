"""Stage 5, export: the recovered model -> one ONNX decoder graph with a KV cache, in a folder
that ONNX Runtime GenAI runs as it is.

``model.onnx`` takes ``input_ids``, ``attention_mask``, ``position_ids`` and the past
keys/values per layer (``past_key_values.N.key``/``.value``; a past of length 0 is a plain
forward pass) and returns ``logits`` and ``present.N.key``/``.value``, with dynamic batch,
sequence and past length (models/onnx_export.py). Beside it: ``genai_config.json``,
``tokenizer.json`` and ``tokenizer_config.json`` (models/onnx_layout.py). The file also carries
the model config and the tokenizer as metadata, so it alone is enough for cpuforge to generate.

The stage then proves the file: ``onnx.checker``, logits against PyTorch on real validation
windows (max abs difference, argmax agreement), and greedy generation with the KV cache in
onnxruntime against PyTorch's, token for token. It fails when either is off.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from cpuforge.models import onnx_files
from cpuforge.models.checkpoint import load_model
from cpuforge.models.onnx_export import META_EOD, META_TOKENIZER, export_decoder
from cpuforge.models.onnx_layout import GENAI_CONFIG, TOKENIZER, TOKENIZER_CONFIG, write_layout
from cpuforge.models.runtime import TorchDecoder, generate, load_language_model
from cpuforge.tasks import stages
from cpuforge.tasks.config.settings import ExportConfig
from cpuforge.tasks.engine.data import open_shards, val_batches
from cpuforge.tasks.infra.stage import StageOutput, StageRun
from cpuforge.tasks.infra.store import StageRecord
from cpuforge.tasks.records.errors import ModelError

log = logging.getLogger("cpuforge.export")

SPEC = stages.EXPORT
PARITY_BATCHES = 2
PARITY_PROMPTS = 4
PARITY_NEW_TOKENS = 32  # greedy tokens compared per prompt (fixed: the stage's key holds only the export section)
PARITY_WINDOW = 512  # positions per parity window, at most: a Hub model's 8k context would cost minutes for no more proof


def work(run: StageRun, export: ExportConfig) -> StageOutput:
    return export_model(export, run.inputs["tokenize"], run.inputs["recover"], run.out_dir)


def export_model(e: ExportConfig, tokenized: StageRecord, recovered: StageRecord, out_dir: Path) -> StageOutput:
    started = time.perf_counter()
    model_dir = recovered.path("model")
    model = load_model(model_dir)
    shards = open_shards(Path(tokenized.output_dir), model.cfg.block_size)
    # Compact JSON: the pretty-printed file is twice the size, and it travels inside the model file.
    metadata = {META_TOKENIZER: Tokenizer.from_file(str(model_dir / "tokenizer.json")).to_str(),
                META_EOD: str(shards.eod_id)}
    path = out_dir / "model.onnx"
    export_decoder(model, path, e.opset, metadata)
    layout = write_layout(out_dir, model.cfg, path.name, model_dir / "tokenizer.json", shards.eod_id)
    export_seconds = time.perf_counter() - started

    onnx_lm = load_language_model(out_dir)  # through the folder, as a user would
    torch_decoder = TorchDecoder(model)
    batches = val_batches(shards.val, PARITY_BATCHES, 8, min(model.cfg.block_size, PARITY_WINDOW))
    diff, agree, total = 0.0, 0, 0
    for x, _ in batches:
        ref, got = torch_decoder.logits(x.numpy()), onnx_lm.decoder.logits(x.numpy())
        diff = max(diff, float(np.abs(ref - got).max()))
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        total += ref.shape[0] * ref.shape[1]
    n_new = min(PARITY_NEW_TOKENS, model.cfg.block_size // 2)
    prompts = [batches[0][0][i, :8].tolist() for i in range(PARITY_PROMPTS)]
    matches = sum(list(generate(torch_decoder, p, n_new)) == list(generate(onnx_lm.decoder, p, n_new)) for p in prompts)
    metrics = {
        "opset": e.opset, "file_bytes": onnx_files.total_bytes(path), "export_seconds": round(export_seconds, 2),
        "parity_max_abs_diff": float(f"{diff:.3g}"), "parity_argmax_agreement": round(agree / total, 5),
        "parity_tokens": total, "generation_match": round(matches / len(prompts), 4),
        "seconds": round(time.perf_counter() - started, 2),
    }
    log.info("exported %s (%.2f MB): max |logit diff| %.2g vs PyTorch, argmax agreement %.4f, "
             "greedy generations identical %d/%d", path.name, metrics["file_bytes"] / 1e6, diff,
             metrics["parity_argmax_agreement"], matches, len(prompts))
    if diff > e.parity_atol:
        raise ModelError(f"the ONNX model's logits differ from PyTorch's by up to {diff:.3g} on validation "
                         f"windows, above export.parity_atol={e.parity_atol:g}: the exported graph is "
                         f"wrong (try another export.opset)")
    if matches < len(prompts):
        raise ModelError(f"greedy generation with the ONNX KV cache differs from PyTorch's on "
                         f"{len(prompts) - matches} of {len(prompts)} prompts: the exported cache is wrong")
    return StageOutput(metrics=metrics, files={"onnx": "model.onnx", "genai_config": GENAI_CONFIG,
                                               "tokenizer": TOKENIZER, "tokenizer_config": TOKENIZER_CONFIG},
                       artifacts=[*onnx_files.files_of(path), *layout],
                       info={"exporter": "torch.onnx dynamo", "torch": torch.__version__})
