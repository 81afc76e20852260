"""One way to run a language model, whatever it is stored as.

A cpuforge model folder (``model.safetensors`` + ``config.json`` + ``tokenizer.json``) runs
in PyTorch; an ``.onnx`` decoder (see models/onnx_export.py), alone or in its ONNX Runtime
GenAI folder (models/onnx_layout.py), runs in onnxruntime with its KV cache. Both offer the
same three calls: ``logits`` (every position's) for scoring, ``prefill`` (a prompt's last
position's, as a generation and llama.cpp's prompt processing need) and ``step`` for
generation. ``generate`` samples from either. The ONNX decoder also runs left-padded
batches (``OnnxDecoder.forward`` with a mask; ``left_pad`` builds one).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from cpuforge.models.checkpoint import CONFIG, WEIGHTS, CheckpointError, load_model
from cpuforge.models.config import LlamaConfig, ModelConfigError
from cpuforge.models.genai_build import shares_kv_buffer
from cpuforge.models.llama import Llama, config_param_count
from cpuforge.models.onnx_export import (
    LOGITS_TO_KEEP,
    META_CONFIG,
    META_EOD,
    META_TOKENIZER,
    decoder_feeds,
    output_names,
    past_names,
)
from cpuforge.models.onnx_layout import GENAI_CONFIG, decoder_file

TOKENIZER = "tokenizer.json"
# Preferred when a folder holds several ONNX files: the deployable one first.
ONNX_NAMES = ("model.int8.onnx", "model.onnx")
KEEP_LAST = np.ones(1, dtype=np.int64)  # logits_to_keep: the last position's logits alone


class ModelLoadError(ValueError):
    """A model path that is missing, unreadable, or lacks what running it needs."""


class Decoder(Protocol):
    cfg: LlamaConfig

    def logits(self, ids: np.ndarray) -> np.ndarray: ...  # (B, T) int64 -> (B, T, vocab) float32

    def prefill(self, ids: np.ndarray) -> tuple[np.ndarray, Any]: ...  # -> (last logits (B, vocab), cache)

    def step(self, ids: np.ndarray, cache: Any, position: int) -> tuple[np.ndarray, Any]: ...


class TorchDecoder:
    def __init__(self, model: Llama) -> None:
        self.model, self.cfg = model.eval(), model.cfg

    @torch.inference_mode()
    def logits(self, ids: np.ndarray) -> np.ndarray:
        return self.model(torch.from_numpy(np.asarray(ids, dtype=np.int64)))[0].float().numpy()

    @torch.inference_mode()
    def prefill(self, ids: np.ndarray) -> tuple[np.ndarray, Any]:
        hidden, cache = self.model(torch.from_numpy(np.asarray(ids, dtype=np.int64)), hidden=True)
        return self.model.lm_head(hidden[:, -1]).float().numpy(), cache  # the head on the last position only

    @torch.inference_mode()
    def step(self, ids: np.ndarray, cache: Any, position: int) -> tuple[np.ndarray, Any]:
        logits, cache = self.model(torch.from_numpy(np.asarray(ids, dtype=np.int64)), cache=cache, start=position)
        return logits[:, -1].float().numpy(), cache


class OnnxDecoder:
    """The exported decoder in onnxruntime: a past of length 0 is a plain forward pass.

    Two kinds of graph. cpuforge's export concatenates past and new keys into a longer present,
    which the next step takes as its past (plain session.run: I/O binding that fed the presents back
    as onnxruntime values measured 0.67-0.87x its speed here, a dozen bind calls per token costing
    more than the copies they save). The graph of ONNX Runtime GenAI's model builder
    (models/genai_build.py, ``shared_kv``) writes into one buffer of the whole context that past and
    present share, bound once per generation (I/O binding); onnxruntime 1.32's GroupQueryAttention
    on CPU computes wrong decode logits from separate buffers, so that graph only decodes this way."""

    def __init__(self, path: Path, cfg: LlamaConfig, threads: int | None = None, shared_kv: bool = False) -> None:
        import onnxruntime as ort

        self.cfg, self.shared_kv = cfg, shared_kv
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        options.log_severity_level = 3  # warnings about unused initializers etc. are not the user's business
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.outputs = output_names(cfg.n_layer)
        # The builder's graph has no position_ids; an input with a default (logits_to_keep) is an overridable
        # initializer to onnxruntime, not one of its inputs.
        self.inputs = {i.name for i in (*self.session.get_inputs(), *self.session.get_overridable_initializers())}
        # Graphs exported before the head could be limited to the last position lack the input: they compute all.
        self.keeps_last = LOGITS_TO_KEEP in self.inputs

    def _feeds(self, ids: np.ndarray, past: list[np.ndarray] | None = None, attention_mask: np.ndarray | None = None,
               position_ids: np.ndarray | None = None, last_only: bool = False) -> dict[str, np.ndarray]:
        feeds = decoder_feeds(self.cfg, ids, past, attention_mask, position_ids)
        if last_only and self.keeps_last:
            feeds[LOGITS_TO_KEEP] = KEEP_LAST
        return {name: value for name, value in feeds.items() if name in self.inputs}

    def forward(self, ids: np.ndarray, past: list[np.ndarray] | None = None, attention_mask: np.ndarray | None = None,
                position_ids: np.ndarray | None = None, last_only: bool = False
                ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Logits (B, T, vocab) and the present keys/values, from one plain session.run. A padded batch
        passes its mask (0 at padding, past + T wide) and each row's positions; without them every slot
        is a real token. ``last_only``: logits of the last position alone (B, 1, vocab) where the graph
        allows it (a left-padded batch's rows all end there)."""
        if self.shared_kv and (past is not None or (attention_mask is not None and not np.all(attention_mask))):
            raise ValueError("this graph (ONNX Runtime GenAI's builder) keeps its KV cache in a shared buffer and "
                             "reads positions from a right-padded mask: continue with prefill/step, not a past")
        feeds = self._feeds(ids, past, attention_mask, position_ids, last_only)
        logits, *present = self.session.run(self.outputs, feeds)
        return logits, present

    def logits(self, ids: np.ndarray) -> np.ndarray:
        return self.session.run(["logits"], self._feeds(ids))[0]

    def prefill(self, ids: np.ndarray) -> tuple[np.ndarray, Any]:
        if self.shared_kv:
            ids = np.ascontiguousarray(ids, dtype=np.int64)
            cache = _SharedCache(self, ids.shape[0])
            return cache.run(ids, 0), cache
        logits, present = self.forward(ids, last_only=True)
        return logits[:, -1], present

    def step(self, ids: np.ndarray, cache: Any, position: int) -> tuple[np.ndarray, Any]:
        if self.shared_kv:
            return cache.run(np.ascontiguousarray(ids, dtype=np.int64), position), cache
        logits, present = self.forward(ids, cache, last_only=True)
        return logits[:, -1], present


class _SharedCache:
    """The builder graph's cache: one (batch, kv heads, context, head_dim) buffer per layer's keys and
    values, bound as both past and present; the mask's width tells the graph how much of it is filled."""

    def __init__(self, decoder: OnnxDecoder, batch: int) -> None:
        import onnxruntime as ort

        cfg = decoder.cfg
        self.decoder, self.binding = decoder, decoder.session.io_binding()
        self.buffers = [np.zeros((batch, cfg.n_kv_head, cfg.block_size, cfg.head_dim), dtype=np.float32)
                        for _ in range(2 * cfg.n_layer)]  # kept referenced: onnxruntime reads and writes them
        self.mask = np.ones((batch, cfg.block_size), dtype=np.int64)
        self.step_logits = np.zeros((batch, 1, cfg.vocab_size), dtype=np.float32)
        self.step_value = ort.OrtValue.ortvalue_from_numpy(self.step_logits)
        self.logits_bound = False  # whether logits go to step_logits (decode) or onnxruntime allocates them
        self.binding.bind_output("logits")  # first, so it is get_outputs()[0]
        for past, present, buffer in zip(past_names(cfg.n_layer), decoder.outputs[1:], self.buffers):
            value = ort.OrtValue.ortvalue_from_numpy(buffer)
            self.binding.bind_ortvalue_input(past, value)
            self.binding.bind_ortvalue_output(present, value)

    def run(self, ids: np.ndarray, position: int) -> np.ndarray:
        seq = ids.shape[1]
        if position + seq > self.decoder.cfg.block_size:
            raise ValueError(f"position {position} + {seq} tokens is past the context ({self.decoder.cfg.block_size})")
        if position == 0 and seq > 1 and self.decoder.keeps_last:
            # onnxruntime's I/O binding cannot set an input that has a default (logits_to_keep), so a prompt's
            # prefill runs plainly from an empty past, the last position's logits alone, and its keys and values
            # are copied into the shared buffers (a few MB, against the head's rows for every other position).
            logits, present = self.decoder.forward(ids, last_only=True)
            for buffer, value in zip(self.buffers, present):
                buffer[:, :, :seq] = value
            return logits[:, -1]
        binding = self.binding
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(self.mask[:, :position + seq]))
        if seq == 1:  # a decode step writes its logits into the same small buffer every time
            if not self.logits_bound:
                binding.bind_ortvalue_output("logits", self.step_value)
                self.logits_bound = True
            self.decoder.session.run_with_iobinding(binding)
            return self.step_logits[:, -1].copy()
        binding.bind_output("logits")
        self.logits_bound = False
        self.decoder.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()[:, -1]


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, attention_mask, position_ids) of prompts of different lengths, padded on the left
    so every row's last token is in the last column; each row's positions start at 0 on its first token."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    positions = np.zeros((len(prompts), width), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        pad = width - len(prompt)
        ids[row, pad:], mask[row, pad:], positions[row, pad:] = prompt, 1, np.arange(len(prompt))
    return ids, mask, positions


@dataclass
class LanguageModel:
    """A decoder with its tokenizer, and where it came from."""

    decoder: Decoder
    tokenizer: Tokenizer
    eod_id: int | None
    kind: str  # "pytorch" | "onnx"
    path: Path
    file_bytes: int
    chat_template: str | None = None  # the Jinja template of tokenizer_config.json (or chat_template.jinja) beside it

    @property
    def cfg(self) -> LlamaConfig:
        return self.decoder.cfg

    @property
    def params(self) -> int:
        return config_param_count(self.cfg)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def stream(self, prompt: str, max_new_tokens: int, temperature: float = 0.8, top_k: int | None = 40,
               seed: int | None = None, top_p: float | None = None) -> Iterator[str]:
        """Yield the continuation of `prompt` as text pieces, as soon as each piece is whole UTF-8."""
        ids = self.encode(prompt)
        check_prompt(len(ids), self.cfg.block_size)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        # Incremental decoding, in the prompt's context (a Metaspace tokenizer's leading space depends on it): each
        # token costs the same however long the text, and a character split across tokens waits for the rest.
        text = DecodeStream(ids=ids, skip_special_tokens=True)
        for token in generate(self.decoder, ids, max_new_tokens, temperature, top_k, self.eod_id, generator, top_p):
            piece = text.step(self.tokenizer, token)
            if piece is not None:
                yield piece

    def complete(self, prompt: str, max_new_tokens: int, temperature: float = 0.8, top_k: int | None = 40,
                 top_p: float | None = None, stop: Sequence[str] = (), seed: int | None = None) -> str:
        """The continuation of `prompt` as one string, cut before the first of the `stop` strings."""
        text = ""
        stop = [s for s in stop if s]
        for piece in self.stream(prompt, max_new_tokens, temperature, top_k, seed, top_p):
            text += piece
            # A stop string can end in this piece while starting in an earlier one: search the whole text.
            cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
            if cuts:
                return text[:min(cuts)]
        return text


def check_prompt(n_tokens: int, block_size: int) -> None:
    if n_tokens == 0:
        raise ValueError("the prompt is empty: give at least one character of text")
    if n_tokens >= block_size:
        raise ValueError(f"the prompt is {n_tokens} tokens long; this model's context is {block_size} tokens, "
                         f"so the prompt must be at most {block_size - 1}: shorten it")


def choose_token(logits: np.ndarray | torch.Tensor, temperature: float, top_k: int | None,
                 generator: torch.Generator | None, top_p: float | None = None) -> int:
    """Greedy at temperature 0, else sampling at that temperature from the top-k tokens, then from the
    fewest of those whose probabilities add up to top_p (nucleus sampling, applied after top-k as in
    transformers). top_k None or 0 and top_p None or 1 mean "off", as in transformers and llama.cpp.
    Greedy takes the argmax of the logits as they come: for a decoder's numpy row a torch round trip
    was 8 us a token, ~5% of an int8 demo model's decode step."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = torch.as_tensor(logits).float()
    logits = logits / temperature
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the ones more likely than it already reach top_p: the first always stays.
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.index_fill(0, order[drop], float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


def generate(decoder: Decoder | Llama, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, stop_token: int | None = None,
             generator: torch.Generator | None = None, top_p: float | None = None) -> Iterator[int]:
    """Continue a prompt with the KV cache, yielding each new token; stops at stop_token or the context."""
    if isinstance(decoder, Llama):
        decoder = TorchDecoder(decoder)
    block = decoder.cfg.block_size
    check_prompt(len(prompt), block)
    logits, cache = decoder.prefill(np.array([prompt]))
    position = len(prompt)
    budget = min(max_new_tokens, block - position)  # every fed token needs a position inside the context
    for i in range(budget):
        token = choose_token(logits[0], temperature, top_k, generator, top_p)
        if stop_token is not None and token == stop_token:
            return
        yield token
        if i + 1 == budget:
            return
        logits, cache = decoder.step(np.array([[token]]), cache, position)
        position += 1


def load_language_model(path: Path, threads: int | None = None) -> LanguageModel:
    """A model folder (PyTorch), an .onnx file, or a folder holding one (an ONNX Runtime GenAI folder: the
    file its genai_config.json names); ModelLoadError says what is wrong."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model not found: {path}")
    if path.is_file() and path.name == WEIGHTS:
        path = path.parent
    if path.is_dir():
        if (path / "model" / CONFIG).is_file():  # a stage's output folder
            path = path / "model"
        if (path / CONFIG).is_file() or (path / WEIGHTS).is_file():
            return _load_torch(path)
        try:
            named = decoder_file(path)
        except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
            raise ModelLoadError(f"{path / GENAI_CONFIG} is not a valid ONNX Runtime GenAI config "
                                 f"({type(exc).__name__}: {exc})") from None
        if named is not None and not named.is_file():
            raise ModelLoadError(f"{path / GENAI_CONFIG} names {named.name}, which is not in {path}")
        onnx_files = [named] if named is not None else (
            [path / name for name in ONNX_NAMES if (path / name).is_file()] or sorted(path.glob("*.onnx")))
        if not onnx_files:
            raise ModelLoadError(f"{path} holds no model: expected {WEIGHTS} + {CONFIG} (PyTorch) or an .onnx file")
        path = onnx_files[0]
    if path.suffix != ".onnx":
        raise ModelLoadError(f"{path}: not a model file (expected an .onnx file or a cpuforge model folder)")
    return _load_onnx(path, threads)


def _load_torch(folder: Path) -> LanguageModel:
    try:
        model = load_model(folder)
    except CheckpointError as exc:
        raise ModelLoadError(str(exc)) from None
    tokenizer_path = folder / TOKENIZER
    if not tokenizer_path.is_file():
        raise ModelLoadError(f"{folder} has no {TOKENIZER}: the model cannot read or write text without the "
                             f"tokenizer it was trained with (copy it from the tokenize stage's output)")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    eos = json.loads((folder / CONFIG).read_text()).get("eos_token_id")  # the transformers layout names it
    eod = eos if isinstance(eos, int) else _eod_of(tokenizer)
    return LanguageModel(TorchDecoder(model), tokenizer, eod, "pytorch", folder,
                         (folder / WEIGHTS).stat().st_size, read_chat_template(folder))


def _load_onnx(path: Path, threads: int | None) -> LanguageModel:
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises its own DecodeError, among others
        raise ModelLoadError(f"{path} is not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    meta = {p.key: p.value for p in proto.metadata_props}
    shared_kv = shares_kv_buffer(proto)
    external = {ExternalDataInfo(t).location for t in proto.graph.initializer if uses_external_data(t)}
    del proto
    missing = sorted(name for name in external if not (path.parent / name).is_file())
    if missing:
        raise ModelLoadError(f"{path}: its weights file {', '.join(missing)} is not beside it (a large model's graph "
                             "and weights travel together)")
    if META_CONFIG not in meta:
        raise ModelLoadError(f"{path} was not exported by cpuforge: its metadata has no {META_CONFIG}")
    try:
        cfg = LlamaConfig.from_dict(json.loads(meta[META_CONFIG]))
    except (json.JSONDecodeError, TypeError, ModelConfigError) as exc:
        raise ModelLoadError(f"{path}: invalid model config in its metadata: {exc}") from None
    if META_TOKENIZER in meta:
        tokenizer = Tokenizer.from_str(meta[META_TOKENIZER])
    elif (path.parent / TOKENIZER).is_file():
        tokenizer = Tokenizer.from_file(str(path.parent / TOKENIZER))
    else:
        raise ModelLoadError(f"{path} carries no tokenizer (metadata {META_TOKENIZER}) and there is no "
                             f"{TOKENIZER} next to it: put the tokenizer the model was trained with there")
    try:
        decoder = OnnxDecoder(path, cfg, threads, shared_kv)
    except Exception as exc:  # onnxruntime reports a bad graph as a generic runtime error
        raise ModelLoadError(f"onnxruntime cannot load {path}: {exc}") from None
    eod = int(meta[META_EOD]) if META_EOD in meta else _eod_of(tokenizer)
    size = path.stat().st_size + sum((path.parent / name).stat().st_size for name in external)
    return LanguageModel(decoder, tokenizer, eod, "onnx", path, size, read_chat_template(path.parent))


def read_chat_template(folder: Path) -> str | None:
    """The chat template saved with a tokenizer: transformers writes chat_template.jinja, older versions a
    "chat_template" entry of tokenizer_config.json (a string, or named templates of which "default" is used)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    try:
        template = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) and template.strip() else None


def _eod_of(tokenizer: Tokenizer) -> int | None:
    special = [t for t in tokenizer.get_added_tokens_decoder().items() if t[1].special]
    return special[0][0] if special else None
