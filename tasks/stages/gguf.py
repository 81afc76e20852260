"""Stage, gguf: the recovered model as GGUF files for llama.cpp, f32, q8_0 and q4_0.

The f32 file holds exactly cpuforge's weights (llama.cpp's greedy generation from it equals
cpuforge's: tests/test_gguf.py); q8_0 is the size most people run on a CPU, q4_0 the smallest
(its logits' matrix stays Q8_0, as llama.cpp's own 4-bit mixes keep that matrix at 6 bits or more).
Each carries the tokenizer, and every matrix of a quantized file is of its type: a width that does
not split into the type's 32-value blocks is an error with the fix (prune.width_multiple aligns
pruned widths to 32 for this stage). The stage reads each file back and checks every tensor against
the model: f32 bit-exact, q8_0 and q4_0 within their step (models/gguf_export.py has the format's details).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
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
FILES = {"gguf_f32": ("model-f32.gguf", "f32"), "gguf_q8_0": ("model-q8_0.gguf", "q8_0"),
         "gguf_q4_0": ("model-q4_0.gguf", "q4_0")}
# How far a block's read-back value may be from the weight, in steps d (q8_0: d = max |w| / 127, an int8 code;
# q4_0: d = max |w| / 8, a 4-bit code in [-8, 7]). Rounding costs half a step, and q4_0's codes stop at +7 where
# its scale's sign put -8 at the largest weight, so a weight of the other sign near it is off by up to a step;
# the f16 scale's rounding (2^-11 d) moves the farthest code (127 or 8) by that much again.
STEP = {"Q8_0": 127, "Q4_0": 8}
STEP_SLACK = {"Q8_0": 0.5 + 127 * 2**-11 + 0.01, "Q4_0": 1.0 + 8 * 2**-11 + 0.01}
FIX = ("prune to widths that are multiples of 32 (prune.width_multiple=32, the default; explicit prune.d_model "
       "and prune.d_mlp likewise), or stop before this stage (--stop-after quantize)")


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
    tensor_types: dict[str, dict[str, int]] = {}
    for role, (name, kind) in FILES.items():
        try:
            types = write_gguf(model, tokenizer, eod_id, out_dir / name, kind)
        except GGUFExportError as exc:
            raise UserError(f"cannot write {name}: {exc}; {FIX}") from None
        metrics[f"{kind}_bytes"] = (out_dir / name).stat().st_size
        check_read_back(out_dir / name, expected, types)
        tensor_types[name] = dict(Counter(types.values()))
        if kind != "f32":
            metrics[f"{kind}_tensors"] = tensor_types[name].get(kind.upper(), 0)
    metrics["f16_fallback_tensors"] = tensor_types[FILES["gguf_q8_0"][0]].get("F16", 0)  # none: misfits are errors
    metrics["seconds"] = round(time.perf_counter() - started, 2)
    log.info("wrote GGUF for llama.cpp: f32 %.2f MB; q8_0 %.2f MB (%d matrices Q8_0); q4_0 %.2f MB (%d matrices "
             "Q4_0, the logits' matrix Q8_0)", metrics["f32_bytes"] / 1e6, metrics["q8_0_bytes"] / 1e6,
             metrics["q8_0_tensors"], metrics["q4_0_bytes"] / 1e6, metrics["q4_0_tensors"])
    return StageOutput(metrics=metrics, files={role: name for role, (name, _) in FILES.items()},
                       # the f32 file stays in the stage folder: 4x the size
                       artifacts=[FILES["gguf_q8_0"][0], FILES["gguf_q4_0"][0]],
                       info={"llama_cpp_pre_tokenizer": "gpt-2", "tensor_types": tensor_types})


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
        else:  # per 32-value block, within STEP_SLACK steps of max|w| / STEP
            blocks = want.reshape(-1, 32)
            step = np.abs(blocks).max(axis=1, keepdims=True) / STEP[types[name]]
            ok = bool((np.abs(got.reshape(-1, 32) - blocks) <= STEP_SLACK[types[name]] * step + 1e-6).all())
        if not ok:
            raise ModelError(f"{path.name}: {name} ({types[name]}) does not read back as the model's weights")
