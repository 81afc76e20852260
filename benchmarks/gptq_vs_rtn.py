"""GPTQ int4 (quantize's gptq-int4 candidate) against round-to-nearest int4 of the same exported graph.

    python benchmarks/gptq_vs_rtn.py EXPORT_DIR TEXT OUT [--batches 8] [--score-tokens 16384]

EXPORT_DIR is an export stage's folder or `cpuforge export`'s output (model.onnx, tokenizer.json); TEXT a UTF-8
file, tokenized as `cpuforge quantize --text` does (its last 10% validates, the rest calibrates). Prints the
seconds and peak memory GPTQ takes, and each file's size, bits per byte against fp32 and KL to fp32 on the same
validation tokens. Round-to-nearest is onnxruntime's MatMulNBitsQuantizer, symmetric blocks of 32, every
MatMul (the LM head too); GPTQ quantizes the head to int8, which the tied lookup reads, as the candidate does.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import numpy as np
import onnx
from tokenizers import Tokenizer

from cpuforge.models import onnx_files
from cpuforge.models.gptq_onnx import quantize_gptq
from cpuforge.models.onnx_export import decoder_feeds
from cpuforge.models.runtime import load_language_model
from cpuforge.tasks.engine.data import BatchSampler, open_shards, token_byte_lengths
from cpuforge.tasks.engine.scoring import score_with_choices
from cpuforge.tasks.release.convert import token_shards
from cpuforge.tasks.stages.quantize import ACCURACY_LEVEL, CALIB_BATCH, CALIB_SEED, prepare_graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export_dir", type=Path)
    parser.add_argument("text", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--batches", type=int, default=8, help="calibration batches (quantize.calib_batches)")
    parser.add_argument("--score-tokens", type=int, default=16_384, help="val tokens scored (quantize.score_tokens)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    fp32 = load_language_model(args.export_dir / "model.onnx")
    tokenizer = args.export_dir / "tokenizer.json"
    eod = Tokenizer.from_file(str(tokenizer)).id_to_token(fp32.eod_id)
    tokens = token_shards(args.out / "tokens", tokenizer, eod, fp32.cfg.block_size, args.text)
    shards = open_shards(Path(tokens.output_dir), fp32.cfg.block_size)
    prepared = prepare_graph(args.export_dir / "model.onnx", args.out / "prepared.onnx")

    sampler = BatchSampler(shards.train, CALIB_BATCH, fp32.cfg.block_size, seed=CALIB_SEED)
    proto = onnx.load(str(prepared))
    started = time.perf_counter()
    replaced = quantize_gptq(proto, (decoder_feeds(fp32.cfg, sampler.batch(i)[0].numpy()) for i in range(args.batches)),
                             accuracy_level=ACCURACY_LEVEL)
    gptq_s = time.perf_counter() - started
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    onnx_files.save(proto, args.out / "gptq.onnx")
    del proto

    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    started = time.perf_counter()
    rtn = MatMulNBitsQuantizer(onnx.load(str(prepared)), bits=4, block_size=32, is_symmetric=True,
                               accuracy_level=ACCURACY_LEVEL)
    rtn.process()
    onnx_files.save(rtn.model.model, args.out / "rtn.onnx")
    rtn_s = time.perf_counter() - started

    val = np.asarray(shards.val[: args.score_tokens + 1])
    byte_lengths = token_byte_lengths(shards.tokenizer_path)
    base, reference, _ = score_with_choices(fp32, val, byte_lengths)
    rows = {"fp32": {"file_mb": round(fp32.file_bytes / 1e6, 1), "val_bpb": round(base.val_bpb, 5)}}
    for name, seconds in (("gptq", gptq_s), ("rtn", rtn_s)):
        lm = load_language_model(args.out / f"{name}.onnx")
        score, _, kl = score_with_choices(lm, val, byte_lengths, reference=reference)
        rows[name] = {"file_mb": round(lm.file_bytes / 1e6, 1), "val_bpb": round(score.val_bpb, 5),
                      "bpb_vs_fp32_pct": round(100 * (score.val_bpb / base.val_bpb - 1), 3),
                      "kl_to_fp32": round(kl, 6), "seconds": round(seconds, 1)}
    print(json.dumps({"matmuls_gptq": replaced, "gptq_peak_rss_gb": round(peak_gb, 2), "batches": args.batches,
                      "block_size": fp32.cfg.block_size, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
