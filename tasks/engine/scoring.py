"""Quality and speed of any language model (PyTorch or ONNX) on the same tokens.

Quality: bits per byte (tokenizer-independent) and perplexity over consecutive,
non-overlapping windows of the model's context. Speed: prefill tokens/s at full context and
decode tokens/s with the KV cache, each the best of a few timed repeats (noise on a shared
machine only ever slows a run down); models compared with each other are timed in alternation
(alternating_speeds), so that noise does not decide between them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from cpuforge.models.runtime import LanguageModel, generate, load_language_model
from cpuforge.tasks.engine.data import bits_per_byte, open_shards, token_byte_lengths
from cpuforge.tasks.engine.hardware import peak_rss_mb
from cpuforge.tasks.records.errors import DataError


@dataclass
class Score:
    val_bpb: float
    ppl: float
    loss: float  # mean nats per token
    tokens: int
    bytes: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def score_tokens(lm: LanguageModel, tokens: np.ndarray, byte_lengths: np.ndarray, batch_size: int = 8,
                 progress: Callable[[int, int], None] | None = None) -> Score:
    """Bits per byte and perplexity of `tokens` (1-D): every token after the first is predicted,
    in consecutive windows of the model's context (the last one may be shorter)."""
    return score_with_choices(lm, tokens, byte_lengths, batch_size, progress, keep_choices=False).score


# How many of each position's most likely tokens a reference keeps: the KL below is exact over them and lumps the
# rest of the vocabulary into one outcome (a lower bound of the full KL, tight where the reference is peaked).
REFERENCE_TOP = 32


class Choices(NamedTuple):
    """Each scored position's REFERENCE_TOP most likely tokens, most likely first, and their log-probabilities:
    two models' greedy choices compare as token agreement, and a model's logits against another's Choices as KL."""
    ids: np.ndarray  # (positions, k) int64
    logp: np.ndarray  # (positions, k) float32

    @property
    def greedy(self) -> np.ndarray:
        return self.ids[:, 0]

    @property
    def top_p(self) -> np.ndarray:
        """The probability of each position's greedy choice."""
        return np.exp(self.logp[:, 0])


class Scored(NamedTuple):
    score: Score
    choices: Choices | None  # None when not kept (score_tokens)
    kl: float | None  # mean KL(reference || model) in nats per token; None without a reference


def score_with_choices(lm: LanguageModel, tokens: np.ndarray, byte_lengths: np.ndarray, batch_size: int = 8,
                       progress: Callable[[int, int], None] | None = None,
                       reference: Choices | None = None, keep_choices: bool = True) -> Scored:
    """score_tokens, with the model's most likely tokens at every scored position from the same forward passes
    and, given a ``reference`` model's Choices on the same tokens, the mean KL divergence from it (quantize's
    candidates against fp32). ``progress(tokens scored, tokens to score)`` is called after every batch."""
    block = lm.cfg.block_size
    tokens = np.asarray(tokens, dtype=np.int64)
    if len(tokens) < 2:
        raise DataError(f"{len(tokens)} token(s) leave nothing to predict: give a longer text")
    n_full = (len(tokens) - 1) // block
    windows = [(tokens[:n_full * block].reshape(n_full, block), tokens[1:n_full * block + 1].reshape(n_full, block))]
    tail = len(tokens) - 1 - n_full * block
    if tail:
        windows.append((tokens[n_full * block:-1][None], tokens[n_full * block + 1:][None]))
    nll, kl, n_bytes, n_tokens = 0.0, 0.0, 0, 0
    ids: list[np.ndarray] = []
    logps: list[np.ndarray] = []
    for x_all, y_all in windows:
        for i in range(0, len(x_all), batch_size):
            x, y = x_all[i:i + batch_size], y_all[i:i + batch_size]
            logits = lm.decoder.logits(x)
            # One log-softmax pass serves the loss, the choices and the KL. In float32 (max-shifted: nothing a
            # float64 pass would keep, 2e-10 apart on a 49,152-wide head), summed in float64; NumPy float64 took
            # ~27x longer (9.6 s per 4,096 tokens at that width, most of evaluating a 100M model).
            logp = torch.log_softmax(torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32)), -1)
            logp = logp.reshape(-1, logp.shape[-1])
            targets = torch.from_numpy(np.asarray(y, dtype=np.int64)).reshape(-1, 1)
            nll -= float(logp.gather(-1, targets).double().sum())
            if keep_choices:
                top = logp.topk(min(REFERENCE_TOP, logp.shape[-1]), -1)
                ids.append(top.indices.numpy())
                logps.append(top.values.numpy())
            if reference is not None:
                at = slice(n_tokens, n_tokens + y.size)
                kl += _kl_over_top(torch.from_numpy(reference.logp[at]),
                                   logp.gather(-1, torch.from_numpy(reference.ids[at])))
            n_bytes += int(byte_lengths[y].sum())
            n_tokens += y.size
            if progress is not None:
                progress(n_tokens, len(tokens) - 1)
    loss = nll / n_tokens
    score = Score(round(bits_per_byte(nll, n_bytes), 5), round(math.exp(loss), 4), round(loss, 5), n_tokens, n_bytes)
    choices = Choices(np.concatenate(ids), np.concatenate(logps)) if keep_choices else None
    return Scored(score, choices, None if reference is None else kl / n_tokens)


def _kl_over_top(ref_logp: torch.Tensor, logq: torch.Tensor) -> float:
    """Summed KL(p || q) over positions, exact on the reference's top tokens, with the rest of the vocabulary as
    one outcome: ref_logp and logq are (positions, k) log-probabilities of the same tokens."""
    logp, logq = ref_logp.double(), logq.double()
    p = logp.exp()
    inside = (p * (logp - logq)).sum(-1)
    p_rest = (1 - p.sum(-1)).clamp_min(0)
    q_rest = (1 - logq.exp().sum(-1)).clamp_min(1e-12)
    rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-300).log() - q_rest.log()), torch.zeros_like(p_rest))
    return float((inside + rest).sum())


def score_text(lm: LanguageModel, text: str, batch_size: int = 8) -> Score:
    """Score a text with the model's own tokenizer (so models with different tokenizers compare fairly)."""
    if not text.strip():
        raise DataError("the text is empty: nothing to score")
    return score_tokens(lm, np.array(lm.encode(text), dtype=np.int64), token_byte_lengths(lm.tokenizer), batch_size)


def prefill_tokens_per_s(lm: LanguageModel, batch: int, seq: int | None = None, repeats: int = 5,
                         seed: int = 0) -> float:
    """Tokens/s of the prefill of (batch, seq)-token prompts, seq defaulting to the full context: the forward pass
    to the KV cache and the next token's logits, the last position's alone (as llama-bench's prompt processing)."""
    ids = _prefill_ids(lm, batch, seq, seed)
    lm.decoder.prefill(ids)  # warm-up: first-call allocations and graph set-up are not throughput
    return ids.size / min(_timed_prefill(lm, ids) for _ in range(repeats))


def _prefill_ids(lm: LanguageModel, batch: int, seq: int | None = None, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, lm.cfg.vocab_size, size=(batch, seq or lm.cfg.block_size))


def _timed_prefill(lm: LanguageModel, ids: np.ndarray) -> float:
    started = time.perf_counter()
    lm.decoder.prefill(ids)
    return time.perf_counter() - started


def _timed_decode(lm: LanguageModel, n_tokens: int, prompt_len: int = 16) -> float:
    """Seconds per token of greedy decoding with the KV cache at batch 1, prefill excluded."""
    n_tokens = min(n_tokens, lm.cfg.block_size - prompt_len - 1)
    stream = generate(lm.decoder, list(range(1, prompt_len + 1)), n_tokens)
    next(stream)  # the first token comes from the prefill
    started = time.perf_counter()
    steps = sum(1 for _ in stream)  # each further token costs one decode step
    return (time.perf_counter() - started) / max(1, steps)


def decode_tokens_per_s(lm: LanguageModel, n_tokens: int, prompt_len: int = 16, repeats: int = 3) -> float:
    """Tokens/s of greedy decoding with the KV cache at batch 1, prefill excluded."""
    _timed_decode(lm, n_tokens, prompt_len)  # the first pass warms up
    return 1.0 / min(_timed_decode(lm, n_tokens, prompt_len) for _ in range(repeats))


Samples = dict[str, dict[str, list[float]]]  # model -> measure ("prefill_b1", "decode") -> tokens/s per round


def alternating_speeds(lms: dict[str, LanguageModel], batch_sizes: list[int], decode_tokens: int,
                       min_rounds: int = 3, max_rounds: int = 3,
                       settled: Callable[[Samples], bool] | None = None, seconds: float | None = None,
                       on_round: Callable[[int, float], None] | None = None) -> Samples:
    """Prefill tokens/s (full-context prompts, each batch size; prefill_tokens_per_s's measure) and decode
    tokens/s (batch 1, KV cache) of several models, measured in rounds that visit every model once, the starting
    model rotating from round to round: machine noise then lands on all of them alike instead of on whichever
    was measured during a busy spell. Rounds go on past min_rounds until `settled(samples)` says the
    figures decide what they are for, or max_rounds, or (with `seconds`) until another round like the
    last would end past that many seconds from the start, warm-up included: the cost then follows the
    caller's budget, not the model's size. A prefill figure is the best of up to 3 passes, one when a
    pass takes a second or more (the rounds then give the best-of). ``on_round(rounds done, seconds
    so far)`` follows it. Summaries take the best round: noise on a shared machine only ever slows a
    run down."""
    started = time.perf_counter()
    names = list(lms)
    ids = {name: {b: _prefill_ids(lm, b) for b in batch_sizes} for name, lm in lms.items()}
    for name, lm in lms.items():  # warm-up: first-call allocations and graph set-up are not throughput
        for b in batch_sizes:
            lm.decoder.prefill(ids[name][b])
        _timed_decode(lm, decode_tokens)
    samples: Samples = {name: {**{f"prefill_b{b}": [] for b in batch_sizes}, "decode": []} for name in names}
    for round_ in range(max_rounds):
        round_started = time.perf_counter()
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            lm = lms[name]
            for b in batch_sizes:
                passes = [_timed_prefill(lm, ids[name][b])]
                while len(passes) < 3 and sum(passes) < 1.0:
                    passes.append(_timed_prefill(lm, ids[name][b]))
                samples[name][f"prefill_b{b}"].append(ids[name][b].size / min(passes))
            samples[name]["decode"].append(1.0 / _timed_decode(lm, decode_tokens))
        now = time.perf_counter()
        if on_round is not None:
            on_round(round_ + 1, now - started)
        # Without a settled rule, min_rounds is enough unless a time cap asks for as many rounds as fit.
        done = settled(samples) if settled is not None else seconds is None
        out_of_time = seconds is not None and (now - started) + (now - round_started) > seconds
        if round_ + 1 >= min_rounds and (done or out_of_time):
            break
    return samples


def best(values: list[float]) -> float:
    return max(values)


def spread(values: list[float]) -> float:
    """The relative gap between the two best rounds: how far the best-of figure could move with one
    more round. (Max minus min would only grow with more rounds, so more rounds could never settle it.)"""
    if len(values) < 2:
        return 1.0
    first, second = sorted(values, reverse=True)[:2]
    return (first - second) / first


Progress = Callable[[str], None]  # one line for the person waiting (measure.py prints it for the parent)


def measure_variant(model_path: str, tokenize_dir: str, max_tokens: int, batch_sizes: list[int],
                    prompts: list[str], max_new_tokens: int, threads: int, seed: int,
                    progress: Progress | None = None) -> dict:
    """Quality, size, peak RSS and samples of one model, meant to run in a fresh process so that
    its peak RSS is this model's alone (its speed: measure_speeds, with the other variants)."""
    torch.set_num_threads(threads)
    lm = load_language_model(Path(model_path), threads=threads)
    val = open_shards(Path(tokenize_dir), lm.cfg.block_size).val[: max_tokens + 1]
    score = score_tokens(lm, np.asarray(val), token_byte_lengths(lm.tokenizer),
                         progress=_every(30.0, progress, "scored {:,} of {:,} tokens"))
    for b in batch_sizes:  # untimed (speed is measured by measure_speeds), but part of this variant's peak RSS
        lm.decoder.prefill(_prefill_ids(lm, b))
    samples = {}
    for prompt in prompts:
        pieces = lm.stream(prompt, max_new_tokens, temperature=0.8, top_k=40, seed=seed)
        samples[prompt] = prompt + "".join(pieces)
    return {
        "format": lm.kind, "params": lm.params, "file_bytes": lm.file_bytes, "val_bpb": score.val_bpb,
        "ppl": score.ppl, "val_tokens": score.tokens, "peak_rss_mb": round(peak_rss_mb(), 1),
        "samples": samples,
    }


def _every(interval_s: float, progress: Progress | None, line: str) -> Callable[..., None] | None:
    """A callback that formats its arguments into `line` for `progress`, at most once every interval_s."""
    if progress is None:
        return None
    last = time.perf_counter()

    def call(*args: object) -> None:
        nonlocal last
        if time.perf_counter() - last >= interval_s:
            last = time.perf_counter()
            progress(line.format(*args))
    return call


def measure_speeds(model_paths: dict[str, str], batch_sizes: list[int], decode_tokens: int, threads: int,
                   rounds: int, min_rounds: int | None = None, seconds: float | None = None,
                   progress: Progress | None = None) -> dict[str, dict]:
    """Prefill and decode tokens/s of every variant, timed in alternation in one process (see
    alternating_speeds), each figure the best of its rounds: `rounds`, or with `seconds` as many from
    min_rounds up as fit. Variants that run the same computation (one format, one shape, one file size:
    the pruned model and the recovered one, in PyTorch) are timed once, and say so ("timed_as")."""
    torch.set_num_threads(threads)
    lms = {name: load_language_model(Path(path), threads=threads) for name, path in model_paths.items()}
    timed_as: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name in reversed(lms):  # the later variant (recovered, not pruned) is the one timed
        lm = lms[name]
        timed_as[name] = seen.setdefault((lm.kind, lm.file_bytes, repr(lm.cfg)), name)
    distinct = {name: lm for name, lm in lms.items() if timed_as[name] == name}

    def on_round(done: int, elapsed: float) -> None:
        if progress is not None:
            progress(f"timing round {done} (at most {rounds}) of {len(distinct)} models done, {elapsed:.0f} s")

    samples = alternating_speeds(distinct, batch_sizes, decode_tokens, min_rounds=min_rounds or rounds,
                                 max_rounds=rounds, seconds=seconds, on_round=on_round)
    out = {}
    for name in lms:
        source = timed_as[name]
        measured = samples[source]
        prefill = {str(b): round(best(measured[f"prefill_b{b}"]), 1) for b in batch_sizes}
        out[name] = {"prefill_tok_s_by_batch": prefill, "prefill_tok_s": prefill[str(batch_sizes[0])],
                     "decode_tok_s": round(best(measured["decode"]), 1),
                     "decode_spread": round(spread(measured["decode"]), 4), "speed_rounds": len(measured["decode"]),
                     **({"timed_as": source} if source != name else {})}
    return out
