"""One GGUF file measured in llama.cpp as evaluate measures cpuforge's variants (scoring.measure_variant and
measure_speeds): bits per byte on the same validation tokens, prefill tokens/s of one full-context sequence at
batch 1, greedy decode tokens/s with the KV cache, peak RSS and samples. Runs in a process of its own
(measure.py), after the others: llama.cpp's thread pool and onnxruntime's or PyTorch's spin against each other
in one process on a small machine, so it is not timed in their alternation; each speed is the best of a few
passes instead."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from cpuforge.models.llama_cpp_runtime import LlamaCppModel, context_length, weight_count
from cpuforge.tasks.engine.data import bits_per_byte, open_shards, token_byte_lengths
from cpuforge.tasks.engine.hardware import int8_dot_product, peak_rss_mb
from cpuforge.tasks.engine.scoring import Progress, _every

PASSES = 3  # timed passes of prefill and of decode, after one warm-up of each


def measure_gguf(model_path: str, tokenize_dir: str, max_tokens: int, prompts: list[str], max_new_tokens: int,
                 decode_tokens: int, threads: int, seed: int, progress: Progress | None = None) -> dict:
    path = Path(model_path)
    context = context_length(path)
    shards = open_shards(Path(tokenize_dir), context)
    val = np.asarray(shards.val[: max_tokens + 1], dtype=np.int64)
    plain = int8_dot_product() == "amx_int8"  # see LlamaCppModel
    scorer = LlamaCppModel(path, context, threads, logits_all=True, plain_buffers=plain)
    nll, n_bytes, n_tokens = scorer.nll(val, token_byte_lengths(shards.tokenizer_path),
                                        progress=_every(30.0, progress, "scored {:,} of {:,} tokens"))
    samples = {prompt: scorer.sample(prompt, max_new_tokens, seed) for prompt in prompts}
    del scorer
    timer = LlamaCppModel(path, context, threads, plain_buffers=plain)
    prefill, decode = timer.best_speeds(decode_tokens, PASSES)
    if progress is not None:
        progress(f"prefill {prefill:,.0f} tok/s, decode {decode:,.0f} tok/s (best of {PASSES})")
    loss = nll / max(1, n_tokens)
    return {
        "format": "gguf", "runtime": "llama.cpp", "params": weight_count(path), "file_bytes": path.stat().st_size,
        "val_bpb": round(bits_per_byte(nll, n_bytes), 5), "ppl": round(math.exp(loss), 4), "val_tokens": n_tokens,
        "prefill_tok_s": round(prefill, 1), "prefill_tok_s_by_batch": {"1": round(prefill, 1)},
        "decode_tok_s": round(decode, 1), "peak_rss_mb": round(peak_rss_mb(), 1), "samples": samples,
    }
