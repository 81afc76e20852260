"""A cpuforge model as GGUF, the file llama.cpp (and ollama, LM Studio, ...) runs.

Written the way llama.cpp's own convert_hf_to_gguf.py writes a LlamaModel: architecture "llama",
tensors under ggml's names (token_embd, blk.N.attn_q, ..., output_norm, output), and the tokenizer
inside the file. Two details decide whether llama.cpp computes what cpuforge computes:

- RoPE layout: cpuforge rotates the halves (x[:d/2], x[d/2:]) of each head (models/llama.py), as
  Hugging Face Llama does; llama.cpp's "llama" architecture rotates adjacent pairs (x[2i], x[2i+1]).
  The rows of wq and wk are permuted per head so that each pair lands where llama.cpp expects it
  (the same permutation convert_hf_to_gguf.py applies).
- Pre-tokenizer: cpuforge's byte-level BPE splits text with GPT-2's regex. llama.cpp picks its
  regex by the name in tokenizer.ggml.pre; "gpt-2" selects exactly that regex (llama-vocab.cpp,
  LLAMA_VOCAB_PRE_TYPE_GPT2). Tokenizers of another kind are refused rather than silently
  tokenized differently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer

from cpuforge.models.llama import Llama

GGUFType = Literal["f32", "f16", "q8_0", "q4_0"]
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
TENSOR_TYPES = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
                "q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
# The matrix that makes the logits stays 8-bit in a 4-bit file: llama-quantize's Q4_0 mix gives it Q6_K
# (a tied token_embd is that matrix), which gguf-py cannot write; Q8_0 is the nearest type it can.
OUTPUT_TYPE_IN_4_BIT = gguf.GGMLQuantizationType.Q8_0
# cpuforge's per-layer weights -> ggml's names (gguf.TENSOR_NAMES for MODEL_ARCH.LLAMA)
LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm", "attn.wq.weight": "attn_q", "attn.wk.weight": "attn_k",
    "attn.wv.weight": "attn_v", "attn.wo.weight": "attn_output", "mlp_norm.weight": "ffn_norm",
    "mlp.gate.weight": "ffn_gate", "mlp.up.weight": "ffn_up", "mlp.down.weight": "ffn_down",
}
LLAMA_CPP_PRE_TOKENIZER = "gpt-2"


class GGUFExportError(ValueError):
    """A model or tokenizer that llama.cpp could not run as cpuforge does."""


def rope_pairs(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's output rows from halves (i, i + d/2) to adjacent pairs (2i, 2i + 1)."""
    out, *rest = weight.shape
    return weight.reshape(n_heads, 2, out // n_heads // 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def gguf_tensors(model: Llama) -> dict[str, np.ndarray]:
    """The model's weights as float32 arrays under ggml's names, q/k in llama.cpp's RoPE layout.
    A tied embedding is written once: llama.cpp uses token_embd as the output matrix when output is absent."""
    cfg = model.cfg
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    tensors = {"token_embd.weight": state["tok_emb.weight"]}
    for i in range(cfg.n_layer):
        for ours, theirs in LAYER_TENSORS.items():
            weight = state[f"blocks.{i}.{ours}"]
            if theirs == "attn_q":
                weight = rope_pairs(weight, cfg.n_head)
            elif theirs == "attn_k":
                weight = rope_pairs(weight, cfg.n_kv_head)
            tensors[f"blk.{i}.{theirs}.weight"] = weight
    tensors["output_norm.weight"] = state["norm.weight"]
    if not cfg.tie_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    return {name: t.contiguous().numpy() for name, t in tensors.items()}


def tensor_type(name: str, array: np.ndarray, kind: GGUFType, names: set[str]) -> gguf.GGMLQuantizationType:
    """The ggml type of one tensor in a file of `kind`: norm weights stay float32 (as in llama.cpp's files),
    every matrix is `kind`, except the logits' matrix of a 4-bit file (OUTPUT_TYPE_IN_4_BIT)."""
    if array.ndim == 1 or kind == "f32":
        return gguf.GGMLQuantizationType.F32
    if kind == "q4_0" and (name == "output.weight" or (name == "token_embd.weight" and "output.weight" not in names)):
        return OUTPUT_TYPE_IN_4_BIT
    return TENSOR_TYPES[kind]


def block_width(qtype: gguf.GGMLQuantizationType) -> int:
    """How many values of a row one block of `qtype` holds (32 for Q8_0 and Q4_0, 256 for the K-quants)."""
    return gguf.GGML_QUANT_SIZES[qtype][0]


def check_blocks(tensors: dict[str, np.ndarray], kind: GGUFType) -> dict[str, gguf.GGMLQuantizationType]:
    """{name: ggml type} for a file of `kind`; a matrix whose rows do not split into its type's blocks is an
    error naming it (llama.cpp's converter would quietly keep it f16, and the file would not be what it says)."""
    types = {name: tensor_type(name, array, kind, set(tensors)) for name, array in tensors.items()}
    misfits = [f"{name} (rows of {array.shape[-1]})" for name, array in tensors.items()
               if array.shape[-1] % block_width(types[name])]
    if misfits:
        raise GGUFExportError(
            f"{kind} stores each row in blocks of {block_width(TENSOR_TYPES[kind])} values, and {len(misfits)} "
            f"matrices have rows that do not split into them: {', '.join(misfits[:4])}"
            + (f" and {len(misfits) - 4} more" if len(misfits) > 4 else ""))
    return types


def vocabulary(tokenizer: Tokenizer, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, their llama.cpp token types, merges as "a b"), after checking that llama.cpp's
    "gpt2" BPE with the "gpt-2" pre-tokenizer reproduces this tokenizer."""
    spec = json.loads(tokenizer.to_str())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    problems = []
    if model.get("type") != "BPE":
        problems.append(f"its model is {model.get('type')}, not BPE")
    if model.get("byte_fallback") or model.get("ignore_merges") or model.get("continuing_subword_prefix") \
            or model.get("end_of_word_suffix"):
        problems.append("its BPE uses byte_fallback, ignore_merges or subword affixes")
    if not (pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")):
        problems.append(f"its pre-tokenizer is {json.dumps(pre)}, not ByteLevel(add_prefix_space=False) "
                        "with GPT-2's regex")
    if spec.get("normalizer") is not None:
        problems.append(f"it has a normalizer ({spec['normalizer'].get('type')})")
    if problems:
        raise GGUFExportError("llama.cpp would tokenize text differently from this tokenizer: "
                              + "; ".join(problems) + " (cpuforge's own byte-level BPE converts)")
    by_id = {i: t for t, i in tokenizer.get_vocab(with_added_tokens=True).items()}
    if by_id and max(by_id) >= vocab_size:
        raise GGUFExportError(f"the tokenizer has ids up to {max(by_id)}, beyond the model's vocab_size={vocab_size}")
    added = tokenizer.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:  # an embedding row no token uses (a vocabulary rounded up)
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL if i not in added else
                         gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, [int(t) for t in types], merges


def write_gguf(model: Llama, tokenizer: Tokenizer, eod_id: int, path: Path, kind: GGUFType = "f32",
               name: str = "cpuforge") -> dict[str, Any]:
    """Write `model` with its tokenizer as one GGUF file; returns {tensor name: ggml type name}.
    Every matrix is of `kind` (a 4-bit file keeps the logits' matrix in Q8_0); one whose rows do not split into
    the type's blocks is a GGUFExportError, raised before anything is written.
    The end-of-document token is llama.cpp's BOS and EOS; nothing is prepended (cpuforge trains without BOS)."""
    if kind not in FILE_TYPES:
        raise GGUFExportError(f"unknown GGUF type {kind!r}; choose one of {', '.join(FILE_TYPES)}")
    cfg = model.cfg
    tokens, token_types, merges = vocabulary(tokenizer, cfg.vocab_size)
    tensors = gguf_tensors(model)
    types = check_blocks(tensors, kind)  # before anything is written
    path = Path(path)
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_name(name)
    writer.add_file_type(FILE_TYPES[kind])
    writer.add_context_length(cfg.block_size)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(cfg.n_layer)
    writer.add_feed_forward_length(cfg.d_mlp)
    writer.add_head_count(cfg.n_head)
    writer.add_head_count_kv(cfg.n_kv_head)
    # Always explicit: after pruning embedding channels, head_dim is no longer d_model / n_head,
    # which is what llama.cpp assumes when these keys are absent.
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(LLAMA_CPP_PRE_TOKENIZER)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(eod_id)
    writer.add_eos_token_id(eod_id)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)

    written = {}
    for tensor_name, array in tensors.items():
        qtype = types[tensor_name]
        data = array.astype(np.float32) if qtype == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(array, qtype)
        writer.add_tensor(tensor_name, data, raw_dtype=qtype)
        written[tensor_name] = qtype.name
    tmp = path.with_name(path.name + ".tmp")  # a crash never leaves a file that looks complete
    try:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    tmp.replace(path)
    return written


def read_gguf_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file as float32 in numpy (row-major) layout, quantized ones dequantized."""
    reader = gguf.GGUFReader(path)
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
            for t in reader.tensors}
