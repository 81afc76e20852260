"""The fused decoder graph ONNX Runtime GenAI's model builder makes from a transformers folder.

The builder (``onnxruntime_genai.models.builder``) reads the save_pretrained folder that
models/hf_format.py writes and emits one Llama graph of onnxruntime's fused CPU kernels:
GroupQueryAttention with the rotary embedding inside it, SkipSimplifiedLayerNormalization (the
residual add and RMSNorm in one op) and, at int8/int4, MatMulNBits weight-only matmuls with
block-wise scales (``accuracy_level`` 4 quantizes the activations to int8 for the product). At
cpuforge's sizes decoding is bound by the per-token cost of each op, so fewer, fused ops per step
is what makes generation fast; the library made for that job is used rather than hand-written
fusions.

Its graph keeps each layer's KV cache in one buffer of the whole context that the past input and
the present output share (GenAI's ``past_present_share_buffer``); models/runtime.py binds it that
way. It has no ``position_ids`` input: positions follow from the attention mask (right padding).
The built graph is saved as one file carrying cpuforge's metadata, so it loads like the export.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from cpuforge.models import onnx_files
from cpuforge.models.onnx_export import add_logits_to_keep, set_metadata

log = logging.getLogger("cpuforge.genai_build")

LM_HEAD = "/lm_head/MatMul"  # the builder's name for the LM head's matmul
EMBEDDING = "/model/embed_tokens/Gather"  # and for the embedding lookup
PRECISIONS = {"fp32": None, "int8": 8, "int4": 4}


class GenaiBuildError(RuntimeError):
    """The builder refused the folder or failed; the message carries its output."""


def build_decoder(hf_folder: Path, target: Path, precision: str, metadata: dict[str, str],
                  accuracy_level: int | None = None, quantize_lm_head: bool = True,
                  block_size: int = 32, algo: str = "default") -> dict[str, Any]:
    """Build the graph of the transformers folder ``hf_folder`` at ``precision`` (fp32, int8, int4) into
    the single file ``target`` with ``metadata`` attached; returns the builder's genai_config (its
    decoder filename set to target's name). ``quantize_lm_head=False`` keeps the LM head in fp32; ``algo`` is the
    builder's algo_config ('default' round-to-nearest, 'k_quant', 'k_quant_last' with an int8 head, ...)."""
    import onnx  # here: runtime.py imports this module for shares_kv_buffer alone

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, not {precision!r}")
    options = []
    if PRECISIONS[precision]:
        options.append(f"block_size={block_size}")
        if algo != "default":
            options.append(f"algo_config={algo}")
        if accuracy_level is not None:
            options.append(f"accuracy_level={accuracy_level}")
        if not quantize_lm_head:
            options.append(f"nodes_to_exclude={LM_HEAD}")
    with tempfile.TemporaryDirectory(prefix="genai-build-", dir=target.parent) as tmp:
        out, cache = Path(tmp) / "out", Path(tmp) / "cache"
        command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_folder), "-o", str(out),
                   "-p", precision, "-e", "cpu", "-c", str(cache)]
        if options:
            command += ["--extra_options", *options]
        # A local folder needs no network: never let the builder's transformers calls reach the hub.
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        done = subprocess.run(command, capture_output=True, text=True, env=env)  # its own process: heavy imports
        if done.returncode != 0 or not (out / "model.onnx").is_file():
            raise GenaiBuildError(f"onnxruntime_genai's builder failed on {hf_folder} ({precision}):\n"
                                  f"{(done.stdout + done.stderr)[-3000:]}")
        proto = onnx.load(str(out / "model.onnx"))  # with its external weights: one file below unless large
        if precision == "int8" and quantize_lm_head and ties_embeddings(hf_folder) and not share_int8_embedding(proto):
            log.warning("the builder's int8 graph of %s keeps its tied embedding as a separate fp32 table: its "
                        "lookup or LM head is not laid out as share_int8_embedding expects", hf_folder)
        add_logits_to_keep(proto.graph)
        set_metadata(proto, metadata)
        onnx_files.save(proto, target, check=False)  # the builder's contrib ops are not in onnx's checker
        config = json.loads((out / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = target.name
    return config


def ties_embeddings(hf_folder: Path) -> bool:
    return bool(json.loads((Path(hf_folder) / "config.json").read_text()).get("tie_word_embeddings", False))


def share_int8_embedding(proto: Any, lookup_name: str = EMBEDDING) -> bool:
    """Let the embedding lookup read the int8 LM head's weights (``GatherBlockQuantized``, bits=8) instead
    of the fp32 table the builder leaves beside them; only for a model that ties the two.

    At int4 the builder shares one table itself; at int8 it keeps a separate fp32 copy (its check says
    GatherBlockQuantized is 4-bit only, but onnxruntime has had the 8-bit kernel since mid-2025, with
    MatMulNBits' layout and default zero point 128). On the demo that copy is half of the file.
    ``lookup_name`` names the Gather. Returns whether the graph changed (not where the head is not a symmetric
    8-bit MatMulNBits)."""
    graph = proto.graph
    head = int8_head(graph)
    lookup = next((n for n in graph.node if n.op_type == "Gather" and n.name == lookup_name), None)
    if head is None or lookup is None:
        return False
    attrs = _attributes(head)
    table = lookup.input[0]
    stored = next((i for i in graph.initializer if i.name == table), None)
    if stored is None or list(stored.dims) != [attrs["N"], attrs["K"]]:  # not the head's (vocab, width) table
        return False
    nodes = gather_head_rows(graph, head, lookup.input[1], lookup.output[0], lookup_name)
    at = list(graph.node).index(lookup)
    graph.node.remove(lookup)
    for node in reversed(nodes):
        graph.node.insert(at, node)
    if not any(table in n.input for n in graph.node) and table not in {o.name for o in graph.output}:
        graph.initializer.remove(stored)
    return True


def _attributes(node: Any) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def int8_head(graph: Any) -> Any:
    """The LM head when it is a symmetric 8-bit MatMulNBits (no zero points: 128), else None."""
    head = next((n for n in graph.node if n.op_type == "MatMulNBits" and "logits" in n.output), None)
    if head is None or _attributes(head).get("bits") != 8 or any(head.input[3:4]):
        return None
    return head


def gather_head_rows(graph: Any, head: Any, ids: str, output: str, prefix: str) -> list[Any]:
    """The nodes that gather rows ``ids`` of the 8-bit MatMulNBits ``head``'s (vocab, width) table into
    ``output`` (their constants added to ``graph``, names under ``prefix``). MatMulNBits stores the head as
    (vocab, blocks, block) uint8 with (vocab, blocks) scales, each row padded to whole blocks: reshaped to
    (vocab, blocks x block) it is the row-wise blocked table GatherBlockQuantized reads, and a Slice drops the
    padding of a width that is not a whole number of blocks (as the builder's int4 sharing does)."""
    from onnx import helper, numpy_helper

    attrs = _attributes(head)
    block, width = attrs["block_size"], attrs["K"]
    padded = -(-width // block) * block

    def constant(name: str, values: list[int]) -> str:
        graph.initializer.append(numpy_helper.from_array(np.array(values, dtype=np.int64), f"{prefix}/{name}"))
        return f"{prefix}/{name}"

    # MatMulNBits takes its scales flat or (vocab, blocks); GatherBlockQuantized wants the table's rank
    nodes = [helper.make_node("Reshape", [head.input[1], constant("shape", [attrs["N"], padded])],
                              [f"{prefix}/table"], name=f"{prefix}/Reshape"),
             helper.make_node("Reshape", [head.input[2], constant("scales_shape", [attrs["N"], padded // block])],
                              [f"{prefix}/scales"], name=f"{prefix}/ReshapeScales")]
    gathered = output if padded == width else f"{prefix}/padded"
    nodes.append(helper.make_node("GatherBlockQuantized", [nodes[0].output[0], ids, nodes[1].output[0]],
                                  [gathered], name=f"{prefix}BlockQuantized", domain="com.microsoft", bits=8,
                                  block_size=block, gather_axis=0, quantize_axis=1))
    if padded != width:
        nodes.append(helper.make_node("Slice", [gathered, constant("start", [0]), constant("end", [width]),
                                                constant("axis", [-1])], [output], name=f"{prefix}/Slice"))
    return nodes


def shares_kv_buffer(proto: Any) -> bool:
    """Whether the graph (an onnx.ModelProto) is the builder's kind, whose past and present KV share one buffer."""
    return any(node.op_type == "GroupQueryAttention" for node in proto.graph.node)
