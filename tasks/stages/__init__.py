"""The stage registry (this package's __init__; the stage modules stand beside it): one declaration per stage — its name, the stages whose outputs it takes, the
config sections it reads (its work function's arguments, and its key), the named outputs it
provides, its module — and the order the flows run them in.

The flows, `cpuforge plan`, `--rebuild`, evaluate's list of model variants and the run summary all
come from here. This module imports no stage (they pull in torch, Prefect and onnxruntime), so
`cpuforge plan` can key every stage in about a second.

Adding a stage: a module tasks/stages/<name>.py (beside this file) with ``SPEC = stages.<NAME>`` and ``work(run, <sections>)``,
one StageSpec below placed in PIPELINE (and COMPRESS), and its config section if it has settings
(tasks/config/settings.py). Nothing else: see docs/architecture.md.
"""

from __future__ import annotations

from typing import Any

from cpuforge.tasks.infra.stage import StageSpec

TOKENIZE = StageSpec(
    name="tokenize", version="1", sections=("data", "tokenizer"), module="cpuforge.tasks.stages.tokenize",
    provides=("tokenizer", "train", "val", "meta"), kind="service", extra="corpus",  # a hub download may fail, then work
)
PRETRAIN = StageSpec(
    name="pretrain", version="1", sections=("model", "train"), module="cpuforge.tasks.stages.pretrain", needs=("tokenize",),
    provides=("model", "tokenizer"), resumable=True, kind="training", evaluates=("pretrained", "model"), extra="source",
)
# The compression flow's stand-in for pretrain: an existing model copied in.
ADOPT = StageSpec(
    name="adopt", version="1", sections=("model", "train"), module="cpuforge.tasks.stages.adopt", needs=("tokenize",),
    provides=("model", "tokenizer"), evaluates=("pretrained", "model"), stands_for="pretrain", extra="source",
)
PRUNE = StageSpec(
    name="prune", version="1", sections=("prune",), module="cpuforge.tasks.stages.prune", needs=("tokenize", "pretrain"),
    provides=("model", "tokenizer"), evaluates=("pruned", "model"),
)
RECOVER = StageSpec(
    name="recover", version="1", sections=("recover", "train"), module="cpuforge.tasks.stages.recover",
    needs=("tokenize", "pretrain", "prune"), provides=("model", "tokenizer"), resumable=True, kind="training",
    evaluates=("recovered", "model"),
)
EXPORT = StageSpec(
    name="export", version="1", sections=("export",), module="cpuforge.tasks.stages.export", needs=("tokenize", "recover"),
    provides=("onnx",), evaluates=("onnx-fp32", "onnx"),
)
QUANTIZE = StageSpec(
    # 2: the rule weighs decode; 3: the model builder's candidates, built from recover's transformers folder
    name="quantize", version="3", sections=("quantize",), module="cpuforge.tasks.stages.quantize",
    needs=("tokenize", "recover", "export"), provides=("onnx",), evaluates=("onnx-int8", "onnx"),
)

# The recovered model as GGUF for llama.cpp. It takes only tokenize and recover (`--rebuild quantize` need not redo
# it); evaluate measures its files in llama.cpp where llama.cpp is installed.
GGUF = StageSpec(
    # 2: a q4_0 file; a matrix that does not fit a type's blocks is an error, not an f16 fallback
    name="gguf", version="2", sections=(), module="cpuforge.tasks.stages.gguf", needs=("tokenize", "recover"),
    provides=("gguf_f32", "gguf_q8_0", "gguf_q4_0"),
)
GGUF_BLOCK = 32  # values per block of a Q8_0 or Q4_0 row: every quantized matrix's width must be a multiple

_MODEL_STAGES = (PRETRAIN, PRUNE, RECOVER, EXPORT, QUANTIZE)
EVALUATE = StageSpec(
    # 2: speeds alternate; 3: the GGUF files in llama.cpp
    name="evaluate", version="3", sections=("eval",), module="cpuforge.tasks.stages.evaluate",
    # every stage that makes a model variant, and the GGUF files: evaluate measures them all on the same tokens
    needs=("tokenize", *(spec.name for spec in _MODEL_STAGES), "gguf"), provides=("variants", "report", "samples"),
)

PIPELINE: tuple[StageSpec, ...] = (TOKENIZE, *_MODEL_STAGES, GGUF, EVALUATE)
COMPRESS: tuple[StageSpec, ...] = tuple(ADOPT if spec is PRETRAIN else spec for spec in PIPELINE)
BY_NAME = {spec.name: spec for spec in (*PIPELINE, ADOPT)}

# The model the pipeline registers: evaluate's final variant (quantize's int8 ONNX model).
FINAL_VARIANT = QUANTIZE.evaluates[0]  # type: ignore[index]
BASELINE_VARIANT = PRETRAIN.evaluates[0]  # type: ignore[index]


def names(order: tuple[StageSpec, ...] = PIPELINE) -> list[str]:
    return [spec.name for spec in order]


def from_stage(name: str, order: tuple[StageSpec, ...] = PIPELINE) -> frozenset[str]:
    """The stage and every stage whose inputs lead back to it: what `--rebuild NAME` rebuilds
    (`--rebuild quantize` redoes evaluate, not gguf, which never reads quantize's output)."""
    order_names = names(order)
    if name not in order_names:
        raise ValueError(f"unknown stage {name!r}; the stages are {', '.join(order_names)}")
    rebuilt, changed = {name}, {name, record_name(BY_NAME[name])}
    for spec in order:
        if changed & set(spec.needs):
            rebuilt.add(spec.name)
            changed |= {spec.name, record_name(spec)}
    return frozenset(rebuilt)


def up_to(name: str, order: tuple[StageSpec, ...] = PIPELINE) -> tuple[StageSpec, ...]:
    """The stages of `order` up to and including `name`: what `--stop-after NAME` runs."""
    order_names = names(order)
    if name not in order_names:
        raise ValueError(f"unknown stage {name!r}; the stages are {', '.join(order_names)}")
    return order[: order_names.index(name) + 1]


def record_name(spec: StageSpec) -> str:
    """The name its record is handed on under (adopt's is "pretrain")."""
    return spec.stands_for or spec.name


def extra_key(spec: StageSpec, cfg: Any, source: Any) -> Any:
    """What the stage's key holds besides config, inputs and code: the corpus' files (tokenize), or the
    hash of the weights the run starts from (pretrain, adopt)."""
    if spec.extra == "corpus":
        from cpuforge.tasks.data.corpus import stage_extra_key

        return stage_extra_key(cfg)
    if spec.extra == "source":
        return source.sha256 if source is not None else None
    return None


def markdown_table(order: tuple[StageSpec, ...] = PIPELINE) -> str:
    """The stages as docs/architecture.md lists them (a test keeps the page equal to this)."""
    rows = ["| stage | needs | config sections | provides | evaluated as |", "|---|---|---|---|---|"]
    for spec in order:
        variant = spec.evaluates[0] if spec.evaluates else ""
        rows.append(f"| {spec.name} | {', '.join(spec.needs) or '-'} | {', '.join(spec.sections)} | "
                    f"{', '.join(spec.provides)} | {variant or '-'} |")
    return "\n".join(rows) + "\n"
