"""Stage 6, quantize: the fp32 ONNX decoder -> int8 with onnxruntime, the better variant kept.

Candidates (``quantize.method``, ``quantize.weight_type``):
- dynamic: int8 weights, activations quantized on the fly per call. Signed (QInt8) and
  unsigned (QUInt8) weights are both tried under ``weight_type=auto``: on CPUs without VNNI
  the u8*s8 kernels can saturate, so which one stays accurate is measured, not assumed.
- static: QDQ with activation ranges calibrated on train-split batches.
Each is scored on the same validation tokens (bits per byte) and timed (prefill tokens/s at
full context, batch 1). Rule: among candidates whose bits per byte is at most
``quantize.max_bpb_increase`` above the fp32 model's, keep the fastest; if none is, keep the
most accurate. The kept one is ``model.int8.onnx``; every candidate stays in ``candidates/``.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import numpy as np
import onnx
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from models.fileio import atomic_write_json, atomic_write_text
from models.onnx_export import (
    empty_past, input_names, read_metadata, reshare_after_quantization, set_metadata, share_tied_embedding,
)
from models.runtime import LanguageModel, load_language_model
from tasks.config import Config
from tasks.data import BatchSampler, open_shards, token_byte_lengths
from tasks.hardware import int8_dot_product
from tasks.publish import finish_stage
from tasks.scoring import prefill_tokens_per_s, score_tokens
from tasks.stage import StageContext, StageOutput, StageSpec, run_stage
from tasks.store import StageRecord

log = logging.getLogger("cpuforge.quantize")

SPEC = StageSpec(name="quantize", version="1", sections=("quantize",), module=__name__)
CALIB_BATCH = 4
CALIB_SEED = 2024  # fixed: the stage's key holds only the quantize section


def candidate_methods(cfg: Config) -> list[str]:
    q = cfg.quantize
    dynamic = {"auto": ["dynamic-qint8", "dynamic-quint8"], "qint8": ["dynamic-qint8"],
               "quint8": ["dynamic-quint8"]}[q.weight_type]
    return {"best": dynamic + ["static-qdq"], "dynamic": dynamic, "static": ["static-qdq"]}[q.method]


def _calibration_reader(shards, cfg: Config, model_cfg):
    from onnxruntime.quantization import CalibrationDataReader

    names = input_names(model_cfg.n_layer)
    sampler = BatchSampler(shards.train, CALIB_BATCH, model_cfg.block_size, seed=CALIB_SEED)

    class TrainBatches(CalibrationDataReader):
        def __init__(self) -> None:
            self.step = 0

        def get_next(self):
            if self.step >= cfg.quantize.calib_batches:
                return None
            x, _ = sampler.batch(self.step)
            self.step += 1
            return {names[0]: x.numpy(), **dict(zip(names[1:], empty_past(model_cfg, CALIB_BATCH)))}

    return TrainBatches()


def quantize_one(method: str, source: Path, target: Path, reader_factory) -> None:
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    if method.startswith("dynamic"):
        weight_type = QuantType.QInt8 if method == "dynamic-qint8" else QuantType.QUInt8
        quantize_dynamic(str(source), str(target), weight_type=weight_type, op_types_to_quantize=["MatMul"])
    else:
        quantize_static(str(source), str(target), reader_factory(), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, reduce_range=True,
                        op_types_to_quantize=["MatMul"], extra_options={"WeightSymmetric": True})
    proto = onnx.load(str(target))
    reshare_after_quantization(proto)
    set_metadata(proto, read_metadata(source))  # the config and tokenizer travel with every variant
    onnx.checker.check_model(proto)
    onnx.save(proto, str(target))


def _measure(lm: LanguageModel, val_tokens: np.ndarray, byte_lengths: np.ndarray) -> dict[str, float]:
    score = score_tokens(lm, val_tokens, byte_lengths)
    return {"val_bpb": score.val_bpb, "file_bytes": lm.file_bytes,
            "prefill_tok_s": round(prefill_tokens_per_s(lm, batch=1, repeats=3), 1)}


def choose(results: dict[str, dict[str, float]], fp32_bpb: float, max_increase: float) -> tuple[str, str]:
    """(kept candidate, why) by the rule in the module docstring."""
    limit = fp32_bpb * (1 + max_increase)
    good = {name: r for name, r in results.items() if r["val_bpb"] <= limit}
    if good:
        name = max(good, key=lambda n: good[n]["prefill_tok_s"])
        return name, (f"fastest of the candidates within {100 * max_increase:g}% of the fp32 bits per byte "
                      f"({fp32_bpb:.4f} -> at most {limit:.4f})")
    name = min(results, key=lambda n: results[n]["val_bpb"])
    return name, f"no candidate stays within {100 * max_increase:g}% of the fp32 bits per byte; kept the most accurate"


def quantize(cfg: Config, tokenized: StageRecord, exported: StageRecord, out_dir: Path) -> StageOutput:
    from onnxruntime.quantization.shape_inference import quant_pre_process

    started = time.perf_counter()
    fp32_path = exported.path("onnx")
    fp32 = load_language_model(fp32_path)
    shards = open_shards(Path(tokenized.output_dir), fp32.cfg.block_size)
    val_tokens = np.asarray(shards.val[: cfg.quantize.score_tokens + 1])
    byte_lengths = token_byte_lengths(shards.tokenizer_path)

    prepared = out_dir / "prepared.onnx"
    # Symbolic shape inference cannot follow the dynamic past length; ONNX's own inference suffices.
    quant_pre_process(str(fp32_path), str(prepared), skip_symbolic_shape=True)
    proto = onnx.load(str(prepared))
    if share_tied_embedding(proto):
        onnx.save(proto, str(prepared))

    results = {"fp32": _measure(fp32, val_tokens, byte_lengths)}
    candidates = out_dir / "candidates"
    candidates.mkdir()
    for method in candidate_methods(cfg):
        target = candidates / f"{method}.onnx"
        t0 = time.perf_counter()
        quantize_one(method, prepared, target, lambda: _calibration_reader(shards, cfg, fp32.cfg))
        results[method] = {**_measure(load_language_model(target), val_tokens, byte_lengths),
                           "quantize_seconds": round(time.perf_counter() - t0, 2)}
        log.info("%s: %.2f MB, val bpb %.4f, prefill %.0f tok/s", method, results[method]["file_bytes"] / 1e6,
                 results[method]["val_bpb"], results[method]["prefill_tok_s"])
    prepared.unlink()

    base = results["fp32"]
    kept, why = choose({k: v for k, v in results.items() if k != "fp32"}, base["val_bpb"], cfg.quantize.max_bpb_increase)
    shutil.copyfile(candidates / f"{kept}.onnx", out_dir / "model.int8.onnx")
    best = results[kept]
    metrics: dict[str, float | int] = {
        "fp32_bytes": base["file_bytes"], "int8_bytes": best["file_bytes"],
        "size_ratio": round(base["file_bytes"] / best["file_bytes"], 3),
        "fp32_val_bpb": base["val_bpb"], "val_bpb": best["val_bpb"],
        "bpb_increase_pct": round(100 * (best["val_bpb"] / base["val_bpb"] - 1), 3),
        "fp32_prefill_tok_s": base["prefill_tok_s"], "prefill_tok_s": best["prefill_tok_s"],
        "speedup_vs_fp32": round(best["prefill_tok_s"] / base["prefill_tok_s"], 3),
        "seconds": round(time.perf_counter() - started, 2),
    }
    for name, r in results.items():
        for key in ("val_bpb", "file_bytes", "prefill_tok_s"):
            metrics[f"{name}/{key}"] = r[key]
    report = {"kept": kept, "rule": why, "int8_dot_product": int8_dot_product(), "results": results}
    atomic_write_json(out_dir / "candidates.json", report)
    atomic_write_text(out_dir / "quantize_report.md", _markdown(report))
    log.info("kept %s: %.2f MB (%.1fx smaller than fp32 ONNX), val bpb %.4f (%+.2f%%), %.2fx the fp32 prefill speed; %s",
             kept, best["file_bytes"] / 1e6, metrics["size_ratio"], best["val_bpb"], metrics["bpb_increase_pct"],
             metrics["speedup_vs_fp32"], why)
    return StageOutput(metrics=metrics, files={"onnx": "model.int8.onnx", "candidates": "candidates",
                                               "report": "quantize_report.md"},
                       artifacts=["model.int8.onnx", "candidates.json", "quantize_report.md"],
                       info={"kept": kept, "rule": why, "int8_dot_product": report["int8_dot_product"]})


def _markdown(report: dict) -> str:
    lines = [f"kept **{report['kept']}**: {report['rule']}", "",
             f"CPU int8 dot-product instructions: {report['int8_dot_product']}", "",
             "| variant | file MB | val bits/byte | prefill tok/s (batch 1) |", "|---|---|---|---|"]
    for name, r in report["results"].items():
        lines.append(f"| {name} | {r['file_bytes'] / 1e6:.2f} | {r['val_bpb']:.4f} | {r['prefill_tok_s']:,.0f} |")
    return "\n".join(lines) + "\n"


@task(name="quantize", cache_policy=NO_CACHE)
def quantize_task(ctx: StageContext, tokenize: StageRecord, export: StageRecord) -> State:
    record = run_stage(SPEC, ctx, lambda out_dir, run_id: quantize(ctx.cfg, tokenize, export, out_dir),
                       inputs={"tokenize": tokenize, "export": export})
    return finish_stage(record, ctx)
