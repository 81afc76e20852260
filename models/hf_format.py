"""The Hugging Face transformers layout of a model folder, read and written without transformers.

A cpuforge model folder is what ``LlamaForCausalLM.save_pretrained`` plus a fast tokenizer's
``save_pretrained`` would write: ``config.json`` (model_type llama), ``model.safetensors`` under
transformers' tensor names, ``generation_config.json``, and ``tokenizer.json`` with
``tokenizer_config.json`` and ``special_tokens_map.json``. So transformers, and the tools that
read its layout, load cpuforge's models, and cpuforge loads Llama checkpoints made elsewhere.

Rotary embeddings need no permutation: cpuforge rotates the pairs (x[:d/2], x[d/2:]), which is
transformers' ``rotate_half`` with the same inverse frequencies.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from cpuforge.models.config import LlamaConfig, ModelConfigError
from cpuforge.models.fileio import atomic_write_json

ARCHITECTURE = "LlamaForCausalLM"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"

# cpuforge name -> transformers name; {i} is the layer.
_GLOBAL = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "lm_head.weight": "lm_head.weight"}
_LAYER = {"attn_norm.weight": "input_layernorm.weight", "attn.wq.weight": "self_attn.q_proj.weight",
          "attn.wk.weight": "self_attn.k_proj.weight", "attn.wv.weight": "self_attn.v_proj.weight",
          "attn.wo.weight": "self_attn.o_proj.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
          "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
          "mlp.down.weight": "mlp.down_proj.weight"}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_GLOBAL_BACK = {v: k for k, v in _GLOBAL.items()}
_CPUFORGE_LAYER = re.compile(r"^blocks\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Buffers some older transformers versions saved; they are recomputed from the config.
_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")


class UnsupportedModel(ModelConfigError):
    """A transformers checkpoint that uses something cpuforge's decoder does not have."""


def is_hf_config(data: dict[str, Any]) -> bool:
    return "model_type" in data or "architectures" in data


def to_hf_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        if name in _GLOBAL:
            out[_GLOBAL[name]] = tensor
        elif (m := _CPUFORGE_LAYER.match(name)) and m.group(2) in _LAYER:
            out[f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"] = tensor
        else:
            raise KeyError(f"no transformers name for tensor {name}")
    return out


def from_hf_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' names -> cpuforge's; a tensor cpuforge has no place for keeps its name (the
    loader then reports it as unexpected)."""
    out = {}
    for name, tensor in state.items():
        if _IGNORED.search(name):
            continue
        if name in _GLOBAL_BACK:
            out[_GLOBAL_BACK[name]] = tensor
        elif (m := _HF_LAYER.match(name)) and m.group(2) in _LAYER_BACK:
            out[f"blocks.{m.group(1)}.{_LAYER_BACK[m.group(2)]}"] = tensor
        else:
            out[name] = tensor
    return out


def hf_config(cfg: LlamaConfig, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json as transformers' LlamaConfig writes it (5.x names, plus rope_theta for older readers)."""
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None, "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "use_cache": True, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "dtype": "float32", "torch_dtype": "float32",
        # head_dim set although d_model / n_head would give it: a pruned model's heads keep their width
        "cpuforge": {"head_dim_explicit": cfg.head_dim_override is not None, **(extra or {})},
    }


def config_from_hf(data: dict[str, Any]) -> LlamaConfig:
    """A transformers Llama config.json -> LlamaConfig; UnsupportedModel names what does not fit."""
    model_type, archs = data.get("model_type"), data.get("architectures") or [ARCHITECTURE]
    if model_type != "llama" or archs != [ARCHITECTURE]:
        raise UnsupportedModel(f"model_type {model_type!r} / architectures {archs}: only llama / "
                               f"{ARCHITECTURE} is supported")
    for flag in ("attention_bias", "mlp_bias"):
        if data.get(flag):
            raise UnsupportedModel(f"{flag}=true: cpuforge's decoder has no biases")
    for key in ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size"):
        if data.get(key):
            raise UnsupportedModel(f"{key}={data[key]}: mixture-of-experts layers are not supported")
    if data.get("sliding_window") or data.get("use_sliding_window"):
        raise UnsupportedModel(f"sliding_window={data.get('sliding_window')}: sliding-window attention is not supported")
    if data.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act={data['hidden_act']!r}: only silu (SwiGLU) is supported")
    if data.get("pretraining_tp", 1) not in (None, 1):
        raise UnsupportedModel(f"pretraining_tp={data['pretraining_tp']}: only 1 is supported")
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or data.get("rope_scaling"):
        raise UnsupportedModel(f"rope scaling {rope_type!r}: only plain rotary embeddings (no rope_scaling) are supported")
    if rope.get("partial_rotary_factor", data.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModel("partial_rotary_factor != 1: only full rotary embeddings are supported")
    n_head, d_model = data["num_attention_heads"], data["hidden_size"]
    head_dim = data.get("head_dim") or d_model // n_head
    explicit = data.get("cpuforge", {}).get("head_dim_explicit", head_dim * n_head != d_model)
    return LlamaConfig(
        vocab_size=data["vocab_size"], n_layer=data["num_hidden_layers"], n_head=n_head,
        n_kv_head=data.get("num_key_value_heads") or n_head, d_model=d_model, d_mlp=data["intermediate_size"],
        block_size=data["max_position_embeddings"], tie_embeddings=bool(data.get("tie_word_embeddings", False)),
        rope_theta=float(rope.get("rope_theta", data.get("rope_theta", 10_000.0))),
        norm_eps=float(data.get("rms_norm_eps", 1e-6)), head_dim_override=head_dim if explicit else None,
    )


def write_tokenizer(folder: Path, tokenizer_json: Path, eod_token: str, eod_id: int) -> None:
    """The tokenizer files transformers' AutoTokenizer reads, with cpuforge's end-of-document token as
    bos, eos and pad; the model's config.json and generation_config.json get its id."""
    folder = Path(folder)
    if Path(tokenizer_json).resolve() != (folder / TOKENIZER).resolve():
        shutil.copy(tokenizer_json, folder / TOKENIZER)
    cfg = json.loads((folder / "config.json").read_text())
    special = {"bos_token": eod_token, "eos_token": eod_token, "pad_token": eod_token, "unk_token": None}
    atomic_write_json(folder / TOKENIZER_CONFIG, {
        "tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": cfg.get("max_position_embeddings"),
    })
    atomic_write_json(folder / SPECIAL_TOKENS_MAP, {k: v for k, v in special.items() if v is not None})
    ids = {"bos_token_id": eod_id, "eos_token_id": eod_id, "pad_token_id": eod_id}
    atomic_write_json(folder / "config.json", {**cfg, **ids})
    atomic_write_json(folder / GENERATION_CONFIG, ids)
