"""Stage, gguf: the recovered model as GGUF files for llama.cpp, f32 and q8_0.

The f32 file holds exactly cpuforge's weights (llama.cpp's greedy generation from it equals
cpuforge's: tests/test_gguf.py); q8_0 is the size most people run on a CPU. Both carry the
tokenizer. The stage reads each file back and checks every tensor against the model: f32 must
be bit-exact, q8_0 within its 8-bit step (models/gguf_export.py has the format's details).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from cpuforge.models.checkpoint import load_model
from cpuforge.models.gguf_export import GGUFExportError, gguf_tensors, read_gguf_tensors, write_gguf
from cpuforge.tasks import stages
from cpuforge.tasks.engine.data import open_shards
from cpuforge.tasks.infra.stage import StageOutput, StageRun
from cpuforge.tasks.infra.store import StageRecord
from cpuforge.tasks.records.errors import ModelError, UserError

log = logging.getLogger("cpuforge.gguf")

SPEC = stages.GGUF
FILES = {"gguf_f32": ("model-f32.gguf", "f32"), "gguf_q8_0": ("model-q8_0.gguf", "q8_0")}
# q8_0 stores each block of 32 weights as int8 times one f16 scale d = max |w| / 127: the error is at
# most half a step (d / 2) plus 127 times the scale's f16 rounding (2^-11 d).
Q8_STEP_SLACK = 0.5 + 127 * 2**-11 + 0.01


def work(run: StageRun) -> StageOutput:
    return export_gguf(run.inputs["tokenize"], run.inputs["recover"], run.out_dir)


def export_gguf(tokenized: StageRecord, recovered: StageRecord, out_dir: Path) -> StageOutput:
    started = time.perf_counter()
    model_dir = recovered.path("model")
    model = load_model(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eod_id = open_shards(Path(tokenized.output_dir), model.cfg.block_size).eod_id
    expected = gguf_tensors(model)
    metrics: dict[str, float | int] = {}
    for role, (name, kind) in FILES.items():
        try:
            types = write_gguf(model, tokenizer, eod_id, out_dir / name, kind)
        except GGUFExportError as exc:
            raise UserError(f"cannot write {name}: {exc}") from None
        metrics[f"{kind}_bytes"] = (out_dir / name).stat().st_size
        check_read_back(out_dir / name, expected, types)
        if kind == "q8_0":
            metrics["q8_0_tensors"] = sum(t == "Q8_0" for t in types.values())
            metrics["f16_fallback_tensors"] = sum(t == "F16" for t in types.values())
    metrics["seconds"] = round(time.perf_counter() - started, 2)
    log.info("wrote GGUF for llama.cpp: f32 %.2f MB, q8_0 %.2f MB (%d matrices whose width is not a multiple "
             "of 32 kept in f16)", metrics["f32_bytes"] / 1e6, metrics["q8_0_bytes"] / 1e6,
             metrics["f16_fallback_tensors"])
    return StageOutput(metrics=metrics, files={role: name for role, (name, _) in FILES.items()},
                       artifacts=[FILES["gguf_q8_0"][0]],  # the f32 file stays in the stage folder: 4x the size
                       info={"llama_cpp_pre_tokenizer": "gpt-2"})


def check_read_back(path: Path, expected: dict[str, np.ndarray], types: dict[str, str]) -> None:
    """The file as a GGUF reader sees it holds the model's tensors, each within its type's rounding."""
    found = read_gguf_tensors(path)
    if set(found) != set(expected):
        raise ModelError(f"{path.name} holds tensors {sorted(set(found) ^ set(expected))} it should not, or lacks them")
    for name, want in expected.items():
        got = found[name]
        if got.shape != want.shape:
            raise ModelError(f"{path.name}: {name} reads back as {got.shape}, expected {want.shape}")
        if types[name] == "F32":
            ok = np.array_equal(got, want)
        elif types[name] == "F16":
            ok = np.allclose(got, want, rtol=1e-3, atol=1e-7)
        else:  # q8_0: per 32-value block, half a step of max|w|/127
            blocks = want.reshape(-1, 32)
            step = np.abs(blocks).max(axis=1, keepdims=True) / 127
            ok = bool((np.abs(got.reshape(-1, 32) - blocks) <= Q8_STEP_SLACK * step + 1e-6).all())
        if not ok:
            raise ModelError(f"{path.name}: {name} ({types[name]}) does not read back as the model's weights")
