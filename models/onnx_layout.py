"""The folder around an exported decoder, in the layout ONNX Runtime GenAI reads.

``genai_config.json`` names the graph file, its inputs and outputs (models/onnx_export.py),
the shape of the KV cache and the token ids that start, end and pad text; ``tokenizer.json``
(the byte-level BPE as the tokenizers library writes it) with ``tokenizer_config.json`` is
the tokenizer GenAI's loader (onnxruntime-extensions) and transformers both read:
``onnxruntime_genai.Model(folder)`` then generates from the folder as it is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from cpuforge.models.config import LlamaConfig
from cpuforge.models.fileio import atomic_write_json
from cpuforge.models.onnx_export import INPUTS, PAST_KEY, PAST_VALUE, PRESENT_KEY, PRESENT_VALUE

GENAI_CONFIG = "genai_config.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# onnxruntime-extensions maps the class to its tokenizer kind (a "Fast" suffix is dropped): this one
# is BPE read from tokenizer.json, and transformers loads it as a plain tokenizers-backed tokenizer.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def genai_config(cfg: LlamaConfig, filename: str, eod_id: int) -> dict[str, Any]:
    """GenAI's config for the decoder graph (fields as its model builder writes them for a Llama).

    cpuforge's text has one special token, the end-of-document mark between training documents: it
    ends a generation, pads a batch, and (as the token every training document follows) begins one.
    """
    return {
        "model": {
            "type": "llama",
            "bos_token_id": eod_id, "eos_token_id": eod_id, "pad_token_id": eod_id,
            "context_length": cfg.block_size,
            "vocab_size": cfg.vocab_size,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": filename,
                "head_size": cfg.head_dim,
                "hidden_size": cfg.d_model,
                "num_attention_heads": cfg.n_head,
                "num_key_value_heads": cfg.n_kv_head,
                "num_hidden_layers": cfg.n_layer,
                "inputs": {**{name: name for name in INPUTS},
                           "past_key_names": PAST_KEY, "past_value_names": PAST_VALUE},
                "outputs": {"logits": "logits", "present_key_names": PRESENT_KEY,
                            "present_value_names": PRESENT_VALUE},
            },
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
            "max_length": cfg.block_size, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
            "num_return_sequences": 1,
            # The export's graph concatenates past and new keys into a longer present: GenAI must not
            # hand it one preallocated buffer for both (the builder's graph wants one: use_decoder_of).
            "past_present_share_buffer": False,
            "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
        },
    }


def tokenizer_config(tokenizer: Tokenizer, eod_id: int, context: int) -> dict[str, Any]:
    eod = tokenizer.id_to_token(eod_id)
    return {
        "tokenizer_class": TOKENIZER_CLASS,
        "bos_token": eod, "eos_token": eod, "pad_token": eod, "unk_token": None,
        # cpuforge never adds tokens around a text: training documents are joined by the eod mark alone.
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
    }


def write_layout(folder: Path, cfg: LlamaConfig, onnx_name: str, tokenizer_path: Path, eod_id: int) -> list[str]:
    """Write the config and tokenizer files next to ``folder/onnx_name``; returns their names."""
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    if Path(tokenizer_path).resolve() != (folder / TOKENIZER).resolve():
        shutil.copyfile(tokenizer_path, folder / TOKENIZER)
    atomic_write_json(folder / TOKENIZER_CONFIG, tokenizer_config(tokenizer, eod_id, cfg.block_size))
    atomic_write_json(folder / GENAI_CONFIG, genai_config(cfg, onnx_name, eod_id))
    return [GENAI_CONFIG, TOKENIZER, TOKENIZER_CONFIG]


def copy_layout(source: Path, folder: Path, onnx_name: str) -> list[str]:
    """The layout of ``source`` (a folder written by write_layout) for another graph file in ``folder``."""
    for name in (TOKENIZER, TOKENIZER_CONFIG):
        shutil.copyfile(source / name, folder / name)
    config = read_genai_config(source)
    config["model"]["decoder"]["filename"] = onnx_name
    atomic_write_json(folder / GENAI_CONFIG, config)
    return [GENAI_CONFIG, TOKENIZER, TOKENIZER_CONFIG]


def use_decoder_of(folder: Path, built_config: Path) -> None:
    """Point ``folder``'s genai_config at a graph of ONNX Runtime GenAI's model builder (models/genai_build.py):
    the builder's decoder section (its inputs: no position_ids) and its KV cache shared between past and
    present, the rest (token ids, tokenizer, search) as cpuforge wrote it."""
    config, built = read_genai_config(folder), json.loads(Path(built_config).read_text())
    filename = config["model"]["decoder"]["filename"]
    config["model"]["decoder"] = {**built["model"]["decoder"], "filename": filename}
    config["search"]["past_present_share_buffer"] = built["search"]["past_present_share_buffer"]
    atomic_write_json(folder / GENAI_CONFIG, config)


def read_genai_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / GENAI_CONFIG).read_text())


def decoder_file(folder: Path) -> Path | None:
    """The graph a GenAI folder names, or None when the folder has no genai_config.json."""
    if not (folder / GENAI_CONFIG).is_file():
        return None
    return folder / read_genai_config(folder)["model"]["decoder"]["filename"]
