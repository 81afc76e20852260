"""The stage registry: one declaration per stage — its name, the stages whose outputs it takes, the
config sections that determine its output, its module — and the order the flows run them in.

This module imports no stage (they pull in torch, Prefect and onnxruntime), so `cpuforge plan` can
key every stage in about a second. A stage module takes its SPEC from here; adding a stage is a
new module, one entry below, and (if it has settings) a config section.
"""

from __future__ import annotations

from cpuforge.tasks.infra.stage import StageSpec

TOKENIZE = StageSpec(name="tokenize", version="1", sections=("data", "tokenizer"), module="cpuforge.tasks.tokenize")
PRETRAIN = StageSpec(name="pretrain", version="1", sections=("model", "train"), module="cpuforge.tasks.pretrain",
                     needs=("tokenize",), resumable=True)
# The compression flow's stand-in for pretrain: an existing model copied in (its record is
# handed on under the name "pretrain").
ADOPT = StageSpec(name="adopt", version="1", sections=("model", "train"), module="cpuforge.tasks.adopt", needs=("tokenize",))
PRUNE = StageSpec(name="prune", version="1", sections=("prune",), module="cpuforge.tasks.prune", needs=("tokenize", "pretrain"))
RECOVER = StageSpec(name="recover", version="1", sections=("recover", "train"), module="cpuforge.tasks.recover",
                    needs=("tokenize", "pretrain", "prune"), resumable=True)
EXPORT = StageSpec(name="export", version="1", sections=("export",), module="cpuforge.tasks.export", needs=("tokenize", "recover"))
QUANTIZE = StageSpec(name="quantize", version="2", sections=("quantize",), module="cpuforge.tasks.quantize",
                     needs=("tokenize", "export"))  # 2: the rule weighs decode
EVALUATE = StageSpec(name="evaluate", version="2", sections=("eval",), module="cpuforge.tasks.evaluate",
                     needs=("tokenize", "pretrain", "prune", "recover", "export", "quantize"))  # 2: speeds alternate
# The final model as GGUF for llama.cpp. Last: it takes only tokenize and recover, and `--rebuild evaluate` need not redo it.
GGUF = StageSpec(name="gguf", version="1", sections=(), module="cpuforge.tasks.gguf", needs=("tokenize", "recover"))

PIPELINE: tuple[StageSpec, ...] = (TOKENIZE, PRETRAIN, PRUNE, RECOVER, EXPORT, QUANTIZE, EVALUATE, GGUF)
COMPRESS: tuple[StageSpec, ...] = (TOKENIZE, ADOPT, PRUNE, RECOVER, EXPORT, QUANTIZE, EVALUATE, GGUF)
BY_NAME = {spec.name: spec for spec in (*PIPELINE, ADOPT)}


def names(order: tuple[StageSpec, ...] = PIPELINE) -> list[str]:
    return [spec.name for spec in order]


def from_stage(name: str, order: tuple[StageSpec, ...] = PIPELINE) -> frozenset[str]:
    """The stage and every stage after it: what `--rebuild NAME` rebuilds."""
    order_names = names(order)
    if name not in order_names:
        raise ValueError(f"unknown stage {name!r}; the stages are {', '.join(order_names)}")
    return frozenset(order_names[order_names.index(name):])
