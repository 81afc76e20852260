"""The README.md model card of a model folder: what a person (or the Hugging Face Hub) reads first.

Written by each stage that writes a model, once its numbers are known: the data, the size and
shape, bits per byte, speed, and the stages and settings that made it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cpuforge.models.checkpoint import read_config
from cpuforge.models.fileio import atomic_write_text
from cpuforge.models.llama import config_param_count
from cpuforge.tasks.infra.store import StageRecord

# (stage, the settings in its key): what made a model, first stage to last
MadeBy = list[tuple[str, dict[str, Any]]]


def made_by(*records: StageRecord) -> MadeBy:
    """The settings that made these stage outputs, as their keys recorded them."""
    return [(r.stage, r.key_parts.get("config", {})) for r in records]


def write_model_card(model_dir: Path, chain: MadeBy, tokenized: StageRecord, metrics: dict[str, Any],
                     origin: str = "") -> None:
    """``chain``: the stages that made the model, first to last, with the settings in their keys (a
    stage reads only its own settings: the earlier ones come from their records); ``origin``: where
    adopted weights came from."""
    shape = read_config(model_dir)
    bpb = metrics.get("val_bpb", metrics.get("val_bpb_after"))
    speed = metrics.get("tokens_per_s")
    heads = (f"{shape.n_head} query / {shape.n_kv_head} key-value heads of width {shape.head_dim}")
    source = (tokenized.dataset or {}).get("source", "?")
    rows = [
        ("parameters", f"{config_param_count(shape):,}"),
        ("shape", f"{shape.n_layer} layers, width {shape.d_model}, {heads}, MLP {shape.d_mlp}, context "
                  f"{shape.block_size}, vocabulary {shape.vocab_size}, "
                  f"{'tied' if shape.tie_embeddings else 'untied'} embeddings"),
        ("data", f"`{source}`: {tokenized.metrics.get('docs_train', '?')} documents, "
                 f"{tokenized.metrics.get('tokens_train', 0):,} tokens in the train split"),
        ("bits per byte (val split)", f"{bpb:.4f}" if bpb is not None else "not measured"),
        ("training speed", f"{speed:,.0f} tokens/s" if speed else "no training in this stage"),
    ]
    if origin:
        rows.append(("started from", origin))
    given_tokenizer = not _tokenizer_trained(tokenized)
    steps = []
    for i, (name, config) in enumerate(chain, 1):
        settings = ", ".join(f"`{section}.{k}={v}`" for section, values in config.items()
                             for k, v in values.items() if v not in (None, "", [], {})
                             and not (given_tokenizer and section == "tokenizer" and k != "eod_token"))
        if name == "tokenize" and given_tokenizer:  # the training settings of a tokenizer it did not train
            settings += ", a given tokenizer (`tokenizer.path`)"
        steps.append(f"{i}. **{name}**: {settings}")
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    text = f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [cpuforge, llama]
---
# cpuforge model ({chain[-1][0]} stage)

A Llama-style decoder made on CPUs by cpuforge, stored as transformers' `save_pretrained` layout.

| | |
|---|---|
{table}

## How it was made
{chr(10).join(steps)}

## Use it
```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained("PATH")
model = AutoModelForCausalLM.from_pretrained("PATH")
ids = tokenizer("def main(", return_tensors="pt").input_ids
print(tokenizer.decode(model.generate(ids, max_new_tokens=40, do_sample=False)[0]))
```
"""
    atomic_write_text(Path(model_dir) / "README.md", text)


def _tokenizer_trained(tokenized: StageRecord) -> bool:
    import json

    try:
        meta = json.loads(tokenized.path("meta").read_text())
    except (KeyError, OSError, ValueError):
        return True
    return bool(meta.get("tokenizer", {}).get("trained", True))
