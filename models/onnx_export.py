"""Export a Llama to one ONNX decoder graph that serves both prefill and decoding.

The names and shapes are those ONNX Runtime GenAI's model builder and optimum write, so
those runtimes load the graph as it is. Inputs: ``input_ids`` (batch, seq) int64,
``attention_mask`` (batch, past + seq) int64 with 0 at padding, ``position_ids`` (batch, seq)
int64 and, per layer N, ``past_key_values.N.key`` / ``past_key_values.N.value`` (batch,
n_kv_head, past, head_dim). Outputs: ``logits`` (batch, seq, vocab) and ``present.N.key`` /
``present.N.value`` (batch, n_kv_head, past + seq, head_dim). Batch, sequence and past length
are dynamic: a past of length 0 is a plain forward pass (prefill, scoring), a past of length P
continues after it (decoding with the KV cache). Left-padded batches work through the mask:
a padding slot is never attended to, and the caller gives each row its own positions.

The graph also carries, as ONNX metadata, the model config and the tokenizer, so one
``.onnx`` file is everything ``cpuforge generate`` needs.

An optional input ``logits_to_keep`` (int64 [1]; transformers' name and meaning) limits the LM head
to the last that many positions; unfed it is 0, every position, which is what scoring needs and what
ONNX Runtime GenAI gets. Generation feeds 1 (``add_logits_to_keep``).
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

from cpuforge.models import onnx_files
from cpuforge.models.llama import Llama

META_CONFIG = "cpuforge.config"
META_TOKENIZER = "cpuforge.tokenizer"
META_EOD = "cpuforge.eod_id"


# GenAI's genai_config spells the per-layer names as printf patterns.
PAST_KEY, PAST_VALUE = "past_key_values.%d.key", "past_key_values.%d.value"
PRESENT_KEY, PRESENT_VALUE = "present.%d.key", "present.%d.value"
INPUTS = ("input_ids", "attention_mask", "position_ids")
LOGITS = "logits"
LOGITS_TO_KEEP = "logits_to_keep"


def past_names(n_layer: int) -> list[str]:
    return [pattern % i for i in range(n_layer) for pattern in (PAST_KEY, PAST_VALUE)]


def input_names(n_layer: int) -> list[str]:
    return [*INPUTS, *past_names(n_layer)]


def output_names(n_layer: int) -> list[str]:
    return ["logits"] + [pattern % i for i in range(n_layer) for pattern in (PRESENT_KEY, PRESENT_VALUE)]


class CachedDecoder(nn.Module):
    """The model with its KV cache as explicit tensors, positions given per row, and a padding mask."""

    def __init__(self, model: Llama) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        m = self.model
        past_len, seq = past[0].shape[2], input_ids.shape[1]
        # (batch, 1, seq, head_dim/2): one rotation per row and token, shared by the heads.
        cos, sin = m.rope_cos[position_ids].unsqueeze(1), m.rope_sin[position_ids].unsqueeze(1)
        # Causal by slot in the cache (a padded row's slots are in order too), and never a padding slot.
        causal = torch.arange(attention_mask.shape[1])[None, :] <= (torch.arange(seq) + past_len)[:, None]
        visible = causal[None, None] & attention_mask.bool()[:, None, None, :]  # (batch, 1, seq, past + seq)
        # An additive float mask: a boolean one exports as Where/IsNaN over every score (a fifth of the run
        # time). The finite minimum, not -inf, keeps a padding query (nothing visible) free of NaN.
        mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
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


def decoder_feeds(model_cfg, ids: np.ndarray, past: list[np.ndarray] | None = None,
                  attention_mask: np.ndarray | None = None, position_ids: np.ndarray | None = None
                  ) -> dict[str, np.ndarray]:
    """onnxruntime feeds for the graph. Without a mask every slot is real and the positions follow the
    past; a padded batch gives its mask (past + seq wide) and positions (seq wide)."""
    ids = np.asarray(ids, dtype=np.int64)
    batch, seq = ids.shape
    if past is None:
        past = empty_past(model_cfg, batch)
    past_len = past[0].shape[2]
    if attention_mask is None:
        attention_mask = np.ones((batch, past_len + seq), dtype=np.int64)
    if position_ids is None:
        position_ids = np.broadcast_to(np.arange(past_len, past_len + seq, dtype=np.int64), (batch, seq))
    return {"input_ids": ids, "attention_mask": np.asarray(attention_mask, dtype=np.int64),
            "position_ids": np.ascontiguousarray(position_ids, dtype=np.int64),
            **dict(zip(past_names(model_cfg.n_layer), past))}


def export_decoder(model: Llama, path: Path, opset: int, metadata: dict[str, str] | None = None) -> None:
    """Write the decoder graph to ``path`` with torch.onnx's dynamo exporter (checked with
    onnx.checker), with metadata attached."""
    cfg = model.cfg
    model = model.eval()
    wrapper = CachedDecoder(model).eval()
    # Example shapes must be distinct and above 1, or the exporter specialises on them.
    ids = torch.zeros((2, 3), dtype=torch.long)
    mask, positions = torch.ones((2, 8), dtype=torch.long), torch.arange(5, 8).repeat(2, 1)
    past = [torch.zeros((2, cfg.n_kv_head, 5, cfg.head_dim)) for _ in range(2 * cfg.n_layer)]
    names_in, names_out = input_names(cfg.n_layer), output_names(cfg.n_layer)
    tmp = path.with_name(path.name + ".exported")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # e.g. "torchvision is not installed" per op
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter is chatty about deprecated internals
        batch, seq, past_len = (torch.export.Dim(n) for n in ("batch", "seq", "past"))
        total = torch.export.Dim.AUTO  # past + seq: the exporter derives it from the graph
        shapes = ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq},
                  tuple([{0: batch, 2: past_len}] * len(past)))
        program = torch.onnx.export(wrapper, (ids, mask, positions, *past), dynamo=True, opset_version=opset,
                                    input_names=names_in, output_names=names_out,
                                    dynamic_shapes=shapes, optimize=True, verbose=False)
        program.save(str(tmp))
    proto = onnx.load(str(tmp))  # with the external weights the exporter writes for a large model
    onnx_files.remove(tmp)
    _name_total_length(proto)
    if cfg.tie_embeddings:
        share_tied_embedding(proto)
    add_logits_to_keep(proto.graph)
    set_metadata(proto, {META_CONFIG: json.dumps(cfg.to_dict()), **(metadata or {})})
    onnx_files.save(proto, path)


def add_logits_to_keep(graph: onnx.GraphProto) -> bool:
    """Give the graph the optional input ``logits_to_keep``: the LM head reads only that many of the last
    positions (0, its default, keeps all). A prompt's prefill needs the last position's logits alone; the
    head's other rows are a quarter of a 135M model's prefill arithmetic at 256 tokens (a 49,152-token
    vocabulary) and a 50 MB output. Returns whether the graph changed (not when the logits come from
    anything but a MatMul or MatMulNBits head, or the input is there already)."""
    head = next((n for n in graph.node if LOGITS in n.output), None)
    if head is None or head.op_type not in ("MatMul", "MatMulNBits") or \
            LOGITS_TO_KEEP in {i.name for i in (*graph.input, *graph.initializer)}:
        return False
    # An initializer that is also a graph input is a default the caller may override (ONNX IR >= 4).
    graph.initializer.extend([numpy_helper.from_array(np.zeros(1, np.int64), LOGITS_TO_KEEP),
                              numpy_helper.from_array(np.array([np.iinfo(np.int64).max]), "logits_to_keep/end"),
                              numpy_helper.from_array(np.ones(1, np.int64), "logits_to_keep/axis")])
    graph.input.append(helper.make_tensor_value_info(LOGITS_TO_KEEP, onnx.TensorProto.INT64, [1]))
    kept = head.input[0] + "/kept"
    nodes = [helper.make_node("Neg", [LOGITS_TO_KEEP], ["logits_to_keep/start"], name="logits_to_keep/Neg"),
             helper.make_node("Slice", [head.input[0], "logits_to_keep/start", "logits_to_keep/end",
                                        "logits_to_keep/axis"], [kept], name="logits_to_keep/Slice")]
    at = list(graph.node).index(head)
    for node in reversed(nodes):
        graph.node.insert(at, node)
    head.input[0] = kept
    return True


def _name_total_length(proto: onnx.ModelProto) -> None:
    """The exporter names the mask's width with a generated symbol; call it what it is, as the present
    outputs do, so readers of the graph (and onnxruntime's shape planner) see one length."""
    mask = next(i for i in proto.graph.input if i.name == "attention_mask")
    generated = mask.type.tensor_type.shape.dim[1].dim_param
    present = proto.graph.output[1].type.tensor_type.shape.dim[2].dim_param  # "past + seq"
    if not generated or not present:
        return
    for info in (*proto.graph.input, *proto.graph.output, *proto.graph.value_info):
        for dim in info.type.tensor_type.shape.dim:
            if dim.dim_param == generated:
                dim.dim_param = present


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
