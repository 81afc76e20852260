"""Quality and speed of any language model (PyTorch or ONNX) on the same tokens.

Quality: bits per byte (tokenizer-independent) and perplexity over consecutive,
non-overlapping windows of the model's context. Speed: prefill tokens/s at full context and
decode tokens/s with the KV cache, each the best of a few timed repeats (noise on a shared
machine only ever slows a run down).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from models.runtime import LanguageModel, generate, load_language_model
from tasks.data import bits_per_byte, open_shards, token_byte_lengths
from tasks.errors import DataError
from tasks.hardware import peak_rss_mb


@dataclass
class Score:
    val_bpb: float
    ppl: float
    loss: float  # mean nats per token
    tokens: int
    bytes: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _log_softmax_nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Summed negative log-likelihood of targets (B, T) under logits (B, T, V), computed in float64."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(z).sum(axis=-1))
    picked = np.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    return float((log_norm - picked).sum())


def score_tokens(lm: LanguageModel, tokens: np.ndarray, byte_lengths: np.ndarray, batch_size: int = 8) -> Score:
    """Bits per byte and perplexity of `tokens` (1-D): every token after the first is predicted,
    in consecutive windows of the model's context (the last one may be shorter)."""
    block = lm.cfg.block_size
    tokens = np.asarray(tokens, dtype=np.int64)
    if len(tokens) < 2:
        raise DataError(f"{len(tokens)} token(s) leave nothing to predict: give a longer text")
    n_full = (len(tokens) - 1) // block
    windows = [(tokens[:n_full * block].reshape(n_full, block), tokens[1:n_full * block + 1].reshape(n_full, block))]
    tail = len(tokens) - 1 - n_full * block
    if tail:
        windows.append((tokens[n_full * block:-1][None], tokens[n_full * block + 1:][None]))
    nll, n_bytes, n_tokens = 0.0, 0, 0
    for x_all, y_all in windows:
        for i in range(0, len(x_all), batch_size):
            x, y = x_all[i:i + batch_size], y_all[i:i + batch_size]
            nll += _log_softmax_nll(lm.decoder.logits(x), y)
            n_bytes += int(byte_lengths[y].sum())
            n_tokens += y.size
    loss = nll / n_tokens
    return Score(round(bits_per_byte(nll, n_bytes), 5), round(math.exp(loss), 4), round(loss, 5), n_tokens, n_bytes)


def score_text(lm: LanguageModel, text: str, batch_size: int = 8) -> Score:
    """Score a text with the model's own tokenizer (so models with different tokenizers compare fairly)."""
    if not text.strip():
        raise DataError("the text is empty: nothing to score")
    return score_tokens(lm, np.array(lm.encode(text), dtype=np.int64), token_byte_lengths(lm.tokenizer), batch_size)


def prefill_tokens_per_s(lm: LanguageModel, batch: int, seq: int | None = None, repeats: int = 5,
                         seed: int = 0) -> float:
    """Tokens/s of a forward pass over (batch, seq) tokens, seq defaulting to the full context."""
    seq = seq or lm.cfg.block_size
    ids = np.random.default_rng(seed).integers(0, lm.cfg.vocab_size, size=(batch, seq))
    lm.decoder.logits(ids)  # warm-up: first-call allocations and graph set-up are not throughput
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        lm.decoder.logits(ids)
        best = min(best, time.perf_counter() - started)
    return batch * seq / best


def decode_tokens_per_s(lm: LanguageModel, n_tokens: int, prompt_len: int = 16, repeats: int = 3) -> float:
    """Tokens/s of greedy decoding with the KV cache at batch 1, prefill excluded."""
    n_tokens = min(n_tokens, lm.cfg.block_size - prompt_len - 1)
    prompt = list(range(1, prompt_len + 1))
    best = math.inf
    for _ in range(repeats + 1):  # the first pass warms up
        stream = generate(lm.decoder, prompt, n_tokens)
        next(stream)  # the first token comes from the prefill
        started = time.perf_counter()
        steps = sum(1 for _ in stream)  # each further token costs one decode step
        best = min(best, (time.perf_counter() - started) / max(1, steps))
    return 1.0 / best


def measure_variant(model_path: str, tokenize_dir: str, max_tokens: int, batch_sizes: list[int],
                    decode_tokens: int, prompts: list[str], max_new_tokens: int, threads: int,
                    seed: int) -> dict:
    """Everything the evaluate stage reports for one model, meant to run in a fresh process so
    that its peak RSS is this model's alone."""
    import torch

    torch.set_num_threads(threads)
    lm = load_language_model(Path(model_path), threads=threads)
    val = open_shards(Path(tokenize_dir), lm.cfg.block_size).val[: max_tokens + 1]
    score = score_tokens(lm, np.asarray(val), token_byte_lengths(lm.tokenizer))
    prefill = {str(b): round(prefill_tokens_per_s(lm, batch=b), 1) for b in batch_sizes}
    samples = {}
    for prompt in prompts:
        pieces = lm.stream(prompt, max_new_tokens, temperature=0.8, top_k=40, seed=seed)
        samples[prompt] = prompt + "".join(pieces)
    return {
        "format": lm.kind, "params": lm.params, "file_bytes": lm.file_bytes, "val_bpb": score.val_bpb,
        "ppl": score.ppl, "val_tokens": score.tokens, "prefill_tok_s_by_batch": prefill,
        "prefill_tok_s": prefill[str(batch_sizes[0])],
        "decode_tok_s": round(decode_tokens_per_s(lm, decode_tokens), 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "samples": samples,
    }
