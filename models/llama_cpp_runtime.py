"""A GGUF file in llama.cpp (through llama-cpp-python), run the way cpuforge runs its own models so that the
figures compare: bits per byte over the same consecutive full-context windows, each from an empty cache; prefill
of one full-context sequence; greedy decode with the KV cache after a 16-token prompt.

llama-cpp-python builds llama.cpp from source (about 6 minutes on 2 cores), so it is an extra (`bench`), and
`missing()` says how to get it rather than failing where it is not installed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

INSTALL_HINT = ("pip install 'cpuforge[bench]' (llama-cpp-python, which builds llama.cpp from source: about "
                "6 minutes on 2 cores)")
PROMPT_LEN = 16  # as scoring.decode_tokens_per_s


def missing() -> str | None:
    """Why llama.cpp cannot run here, or None when it can."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return f"llama.cpp is not installed: {INSTALL_HINT}"
    return None


def version() -> str:
    import llama_cpp

    return f"llama-cpp-python {llama_cpp.__version__}"


def context_length(path: Path) -> int:
    """The context the file was written with (cpuforge's block_size)."""
    import gguf

    return int(gguf.GGUFReader(path).fields["llama.context_length"].contents())


def weight_count(path: Path) -> int:
    """Values in the file's tensors (the model's parameters, whatever their type)."""
    import gguf

    return int(sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors))


class LlamaCppModel:
    """One GGUF file in llama.cpp with a context of `context` tokens (`options`: more of llama_cpp.Llama's
    arguments). `plain_buffers` keeps the weights in
    llama.cpp's plain CPU buffers: on a CPU with AMX-INT8 its AMX buffer type crashed on any batch of more than
    one token of a Q8_0 model (llama-cpp-python 0.3.36; ggml-org/llama.cpp#20824)."""

    def __init__(self, path: Path, context: int, threads: int, logits_all: bool = False,
                 plain_buffers: bool = False, **options) -> None:
        import llama_cpp

        bindings = llama_cpp.llama_cpp  # where Llama() reads its default model parameters from
        defaults = bindings.llama_model_default_params

        def without_extra_buffers():
            params = defaults()
            params.use_extra_bufts = False
            return params

        if plain_buffers:
            bindings.llama_model_default_params = without_extra_buffers
        try:
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=context, n_batch=context, n_ubatch=context,
                                       n_threads=threads, n_threads_batch=threads, logits_all=logits_all,
                                       verbose=False, **options)
        finally:
            bindings.llama_model_default_params = defaults
        self.context = context

    def nll(self, tokens: np.ndarray, byte_lengths: np.ndarray,
            progress: Callable[[int, int], None] | None = None) -> tuple[float, int, int]:
        """(summed negative log-likelihood in nats, bytes, tokens) of every token after the first, in the
        windows scoring.score_tokens uses. Needs logits_all."""
        nll, n_bytes, n_tokens = 0.0, 0, 0
        for start in range(0, len(tokens) - 1, self.context):
            y = np.asarray(tokens[start + 1:start + self.context + 1], dtype=np.int64)
            x = tokens[start:start + len(y)]
            self.llm.reset()
            self.llm.eval([int(t) for t in x])
            logits = torch.from_numpy(np.asarray(self.llm.scores[:len(x)], dtype=np.float32))
            nll += float(torch.nn.functional.cross_entropy(logits, torch.from_numpy(y), reduction="sum").double())
            n_bytes += int(byte_lengths[y].sum())
            n_tokens += len(y)
            if progress is not None:
                progress(n_tokens, len(tokens) - 1)
        return nll, n_bytes, n_tokens

    def _next_token(self) -> int:  # without logits_all llama-cpp-python keeps no scores: read the last row
        return int(np.argmax(np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.llm.n_vocab(),))))

    def prefill_seconds(self, ids: list[int]) -> float:
        self.llm.reset()
        started = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - started

    def decode_seconds(self, n_tokens: int) -> float:
        """Seconds per greedy token with the KV cache, the prompt's prefill excluded (as scoring._timed_decode)."""
        n = max(2, min(n_tokens, self.context - PROMPT_LEN - 1))
        self.llm.reset()
        self.llm.eval(list(range(1, PROMPT_LEN + 1)))
        token = self._next_token()
        started = time.perf_counter()
        for _ in range(n - 1):
            self.llm.eval([token])
            token = self._next_token()
        return (time.perf_counter() - started) / (n - 1)

    def best_speeds(self, decode_tokens: int, passes: int = 3) -> tuple[float, float]:
        """(prefill, decode) tokens/s, each the best of `passes` after one warm-up: prefill of one full-context
        sequence of random ids (scoring._prefill_ids's draw), decode_seconds for decode."""
        ids = np.random.default_rng(0).integers(0, self.llm.n_vocab(), size=self.context).tolist()
        self.prefill_seconds(ids), self.decode_seconds(decode_tokens)  # first-call allocations are not throughput
        prefill = self.context / min(self.prefill_seconds(ids) for _ in range(passes))
        return prefill, 1.0 / min(self.decode_seconds(decode_tokens) for _ in range(passes))

    def sample(self, prompt: str, max_new_tokens: int, seed: int) -> str:
        """The prompt and a continuation sampled by llama.cpp at temperature 0.8, top-k 40 (its own sampler and
        random numbers: the same settings as cpuforge's samples, not the same draws)."""
        self.llm.reset()
        out = self.llm.create_completion(prompt, max_tokens=max_new_tokens, temperature=0.8, top_k=40, top_p=1.0,
                                         min_p=0.0, repeat_penalty=1.0, seed=seed)
        return prompt + out["choices"][0]["text"]
