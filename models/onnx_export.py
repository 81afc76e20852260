"""Export a Llama to one ONNX decoder graph that serves both prefill and decoding.

Inputs: ``input_ids`` (batch, seq) and, per layer, ``past_key_i`` / ``past_value_i``
(batch, n_kv_head, past, head_dim). Outputs: ``logits`` (batch, seq, vocab) and
``present_key_i`` / ``present_value_i`` (batch, n_kv_head, past + seq, head_dim). Batch,
sequence and past length are dynamic: a past of length 0 is a plain forward pass (prefill,
scoring), a past of length P continues from position P (decoding with the KV cache).

The graph also carries, as ONNX metadata, the model config and the tokenizer, so one
``.onnx`` file is everything ``cpuforge generate`` needs.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from torch import nn

from cpuforge.models.llama import Llama

META_CONFIG = "cpuforge.config"
META_TOKENIZER = "cpuforge.tokenizer"
META_EOD = "cpuforge.eod_id"


def input_names(n_layer: int) -> list[str]:
    return ["input_ids"] + [f"past_{kind}_{i}" for i in range(n_layer) for kind in ("key", "value")]


def output_names(n_layer: int) -> list[str]:
    return ["logits"] + [f"present_{kind}_{i}" for i in range(n_layer) for kind in ("key", "value")]


class CachedDecoder(nn.Module):
    """The model with its KV cache as explicit tensors and positions derived from the past length."""

    def __init__(self, model: Llama) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        m = self.model
        past_len, seq = past[0].shape[2], input_ids.shape[1]
        positions = torch.arange(seq) + past_len
        cos, sin = m.rope_cos[positions], m.rope_sin[positions]
        visible = torch.arange(past_len + seq)[None, :] <= positions[:, None]  # (seq, past + seq)
        # An additive float mask: a boolean one exports as Where/IsNaN over every score (a fifth of the run time).
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
        x = m.tok_emb(input_ids)
        presents: list[torch.Tensor] = []
        for i, block in enumerate(m.blocks):
            x, (k, v) = block(x, cos, sin, (past[2 * i], past[2 * i + 1]), mask)
            presents += [k, v]
        return (m.lm_head(m.norm(x)), *presents)


def empty_past(model_cfg, batch: int) -> list[np.ndarray]:
    """The past keys/values of a plain forward pass (length 0), as onnxruntime feeds."""
    empty = np.zeros((batch, model_cfg.n_kv_head, 0, model_cfg.head_dim), dtype=np.float32)
    return [empty] * (2 * model_cfg.n_layer)


def export_decoder(model: Llama, path: Path, opset: int, metadata: dict[str, str] | None = None) -> None:
    """Write the decoder graph to ``path`` with torch.onnx's dynamo exporter (checked with
    onnx.checker), with metadata attached."""
    cfg = model.cfg
    model = model.eval()
    wrapper = CachedDecoder(model).eval()
    # Example shapes must be distinct and above 1, or the exporter specialises on them.
    ids = torch.zeros((2, 3), dtype=torch.long)
    past = [torch.zeros((2, cfg.n_kv_head, 5, cfg.head_dim)) for _ in range(2 * cfg.n_layer)]
    names_in, names_out = input_names(cfg.n_layer), output_names(cfg.n_layer)
    tmp = path.with_name(path.name + ".tmp")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # e.g. "torchvision is not installed" per op
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter is chatty about deprecated internals
        batch, seq, past_len = (torch.export.Dim(n) for n in ("batch", "seq", "past"))
        shapes = [{0: batch, 1: seq}] + [{0: batch, 2: past_len}] * len(past)
        program = torch.onnx.export(wrapper, (ids, *past), dynamo=True, opset_version=opset,
                                    input_names=names_in, output_names=names_out,
                                    dynamic_shapes=(shapes[0], tuple(shapes[1:])), optimize=True, verbose=False)
        program.save(str(tmp))
    proto = onnx.load(str(tmp))
    if cfg.tie_embeddings:
        share_tied_embedding(proto)
    set_metadata(proto, {META_CONFIG: json.dumps(cfg.to_dict()), **(metadata or {})})
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, str(tmp))
    tmp.replace(path)


def _embedding_gather(graph: onnx.GraphProto) -> onnx.NodeProto | None:
    return next((n for n in graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"), None)


def _drop_unused_initializers(graph: onnx.GraphProto) -> None:
    used = {name for node in graph.node for name in node.input}
    keep = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)


def share_tied_embedding(proto: onnx.ModelProto) -> bool:
    """Store a tied embedding once. The exporter keeps the (vocab, d) table for the lookup and
    folds a transposed (d, vocab) copy for the LM head; with the lookup rewritten to gather
    columns of the transposed copy, the table is stored (and later quantized) once."""
    graph = proto.graph
    gather = _embedding_gather(graph)
    if gather is None:
        return False
    inits = {init.name: init for init in graph.initializer}
    if gather.input[0] not in inits:
        return False
    table = numpy_helper.to_array(inits[gather.input[0]])
    transposed = next((init for init in graph.initializer if list(init.dims) == [table.shape[1], table.shape[0]]
                       and np.array_equal(numpy_helper.to_array(init), table.T)), None)
    if transposed is None:  # not the layout the dynamo exporter writes: leave the graph as it is
        return False
    embedding = gather.output[0]
    gather.input[0], gather.output[0] = transposed.name, embedding + "_columns"
    del gather.attribute[:]
    gather.attribute.append(helper.make_attribute("axis", 1))
    at = list(graph.node).index(gather)
    graph.node.insert(at + 1, helper.make_node("Transpose", [embedding + "_columns"], [embedding], perm=[1, 2, 0],
                                               name="tied_embedding_columns_to_rows"))
    _drop_unused_initializers(graph)
    return True


def reshare_after_quantization(proto: onnx.ModelProto) -> None:
    """After quantization the LM head reads an int8 copy of the shared table while the lookup
    still holds the fp32 one: point the lookup at the int8 table (dequantizing only the rows
    it gathers), so the file keeps a single, int8, table."""
    graph = proto.graph
    gather = _embedding_gather(graph)
    if gather is None:
        return
    source = gather.input[0]
    inits = {init.name for init in graph.initializer}
    if source + "_quantized" in inits:  # QOperator format: MatMulInteger reads <name>_quantized
        columns = gather.output[0]
        gather.input[0], gather.output[0] = source + "_quantized", columns + "_int8"
        at = list(graph.node).index(gather)
        graph.node.insert(at + 1, helper.make_node(
            "DequantizeLinear", [columns + "_int8", source + "_scale", source + "_zero_point"], [columns],
            name="tied_embedding_dequantize"))
    _drop_unused_initializers(graph)


def set_metadata(proto: onnx.ModelProto, values: dict[str, str]) -> None:
    existing = {p.key: p for p in proto.metadata_props}
    for key, value in values.items():
        if key in existing:
            existing[key].value = value
        else:
            proto.metadata_props.add(key=key, value=value)


def read_metadata(path: Path) -> dict[str, str]:
    proto = onnx.load(str(path), load_external_data=False)
    return {p.key: p.value for p in proto.metadata_props}
