"""models/genai_build.share_int8_embedding on graphs laid out as ONNX Runtime GenAI's builder lays them out, and
models/gptq_onnx.quantize_head on the exported graph's: the embedding lookup then reads the int8 LM head's blocks,
whole or padded, and gives the rows the head holds."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cpuforge.models.genai_build import EMBEDDING, share_int8_embedding, ties_embeddings

VOCAB, BLOCK = 48, 32


def _quantized_head(table: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits' int8 layout of a (vocab, width) table: rows padded to whole blocks, symmetric blocks around
    zero point 128; returns (uint8 (vocab, blocks, BLOCK), scales (vocab, blocks), the dequantized table)."""
    vocab, width = table.shape
    blocks = -(-width // BLOCK)
    padded = np.zeros((vocab, blocks * BLOCK), np.float32)
    padded[:, :width] = table
    grouped = padded.reshape(vocab, blocks, BLOCK)
    scales = np.abs(grouped).max(-1) / 127
    q = np.clip(np.round(grouped / scales[..., None]), -127, 127)
    dequantized = (q * scales[..., None]).reshape(vocab, -1)[:, :width]
    return (q + 128).astype(np.uint8), scales.astype(np.float32), dequantized.astype(np.float32)


def _builder_like_graph(width: int, flat_scales: bool = False) -> tuple[onnx.ModelProto, np.ndarray]:
    """ids -> Gather(fp32 table) -> MatMulNBits(int8 head) -> logits, with the builder's names; also returns
    the table the head dequantizes to."""
    table = np.random.default_rng(width).normal(size=(VOCAB, width)).astype(np.float32)
    q, scales, dequantized = _quantized_head(table)
    lookup = helper.make_node("Gather", ["model.embed_tokens.weight", "input_ids"], [f"{EMBEDDING}/output_0"],
                              name=EMBEDDING)
    head = helper.make_node("MatMulNBits", [f"{EMBEDDING}/output_0", "lm_head.MatMul.weight_Q8",
                                            "lm_head.MatMul.weight_scales"], ["logits"], name="/lm_head/MatMul_Q8",
                            domain="com.microsoft", K=width, N=VOCAB, bits=8, block_size=BLOCK)
    graph = helper.make_graph(
        [lookup, head], "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["B", "T"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "T", VOCAB])],
        [numpy_helper.from_array(table, "model.embed_tokens.weight"),
         numpy_helper.from_array(q, "lm_head.MatMul.weight_Q8"),
         # the builder writes (vocab, blocks) scales; MatMulNBits also takes them flat
         numpy_helper.from_array(scales.reshape(-1) if flat_scales else scales, "lm_head.MatMul.weight_scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return model, dequantized


def _logits(model: onnx.ModelProto, ids: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"input_ids": ids})[0]


@pytest.mark.parametrize("flat_scales", [False, True])
@pytest.mark.parametrize("width", [64, 40])  # whole blocks, and a pruned width the head pads to 64
def test_embedding_reads_the_int8_heads_rows(width, flat_scales):
    model, dequantized = _builder_like_graph(width, flat_scales)
    ids = np.array([[0, 7, 47, 7], [3, 1, 2, 46]], dtype=np.int64)
    assert share_int8_embedding(model)
    onnx.checker.check_model(model)  # a valid graph, its nodes in order
    assert not share_int8_embedding(model)  # a second call finds nothing left to share
    assert {i.name for i in model.graph.initializer}.isdisjoint({"model.embed_tokens.weight"})  # no fp32 table left
    assert [n.op_type for n in model.graph.node if n.domain == "com.microsoft"] == ["GatherBlockQuantized",
                                                                                     "MatMulNBits"]
    # the lookup now yields the head's own (dequantized) rows: logits = rows . head's rows
    expected = dequantized[ids] @ dequantized.T
    np.testing.assert_allclose(_logits(model, ids), expected, rtol=1e-4, atol=1e-3)


def test_a_head_that_is_not_8_bit_is_left_alone():
    model, _ = _builder_like_graph(64)
    for attribute in model.graph.node[1].attribute:
        if attribute.name == "bits":
            attribute.i = 4
    before = model.SerializeToString()
    assert not share_int8_embedding(model) and model.SerializeToString() == before


@pytest.mark.parametrize(("config", "tied"), [({"tie_word_embeddings": True}, True),
                                              ({"tie_word_embeddings": False}, False), ({}, False)])
def test_only_a_tied_model_shares_its_table(tmp_path, config, tied):
    """An untied model's embedding and LM head are different weights: sharing would read the wrong rows
    (transformers' LlamaConfig leaves them untied when config.json does not say)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    assert ties_embeddings(tmp_path) is tied


@pytest.mark.parametrize("layout", ["rows", "columns"])
@pytest.mark.parametrize("width", [64, 40])
def test_gptq_head_is_int8_and_the_exported_lookup_reads_it(width, layout):
    """The tied layouts quantize meets: the exporter's (a Gather of the table's rows, the head reading its
    Transpose) and the one after onnxruntime's pre-processing (the head reading the folded (width, vocab) copy,
    the lookup gathering its columns and transposing them to rows). The head becomes 8-bit MatMulNBits, the
    lookup gathers its blocks, and no fp32 table is left."""
    from cpuforge.models.gptq_onnx import quantize_head

    table = np.random.default_rng(width).normal(size=(VOCAB, width)).astype(np.float32)
    _, _, dequantized = _quantized_head(table)
    if layout == "rows":
        nodes = [helper.make_node("Gather", ["table", "input_ids"], ["rows"], name="node_embedding"),
                 helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]),
                 helper.make_node("MatMul", ["rows", "table_t"], ["logits"], name="head")]
        stored = numpy_helper.from_array(table, "table")
    else:
        nodes = [helper.make_node("Gather", ["table_t", "input_ids"], ["columns"], name="node_embedding", axis=1),
                 helper.make_node("Transpose", ["columns"], ["rows"], perm=[1, 2, 0]),
                 helper.make_node("MatMul", ["rows", "table_t"], ["logits"], name="head")]
        stored = numpy_helper.from_array(np.ascontiguousarray(table.T), "table_t")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["B", "T"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "T", VOCAB])],
                              [stored])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    ids = np.array([[0, 7, 47, 7]], dtype=np.int64)
    assert quantize_head(model, BLOCK, accuracy_level=0)
    onnx.checker.check_model(model)
    assert [i.name for i in model.graph.initializer if i.data_type == TensorProto.FLOAT and len(i.dims) == 2
            and VOCAB in i.dims and not i.name.endswith("_scale")] == []
    assert sorted(n.op_type for n in model.graph.node if n.domain == "com.microsoft") == ["GatherBlockQuantized",
                                                                                           "MatMulNBits"]
    np.testing.assert_allclose(_logits(model, ids), dequantized[ids] @ dequantized.T, rtol=1e-4, atol=1e-3)


def test_gptq_head_of_an_untied_model_is_int8_and_its_lookup_keeps_its_own_table():
    """An untied head reads its own (width, vocab) weight: it becomes 8-bit, and the lookup still gathers the
    embedding's rows, not the head's."""
    from cpuforge.models.gptq_onnx import quantize_head

    rng = np.random.default_rng(1)
    embedding = rng.normal(size=(VOCAB, 64)).astype(np.float32)
    head = rng.normal(size=(VOCAB, 64)).astype(np.float32)
    _, _, dequantized = _quantized_head(head)
    nodes = [helper.make_node("Gather", ["embedding", "input_ids"], ["rows"], name="node_embedding"),
             helper.make_node("MatMul", ["rows", "head_t"], ["logits"], name="head")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["B", "T"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "T", VOCAB])],
                              [numpy_helper.from_array(embedding, "embedding"),
                               numpy_helper.from_array(np.ascontiguousarray(head.T), "head_t")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    ids = np.array([[0, 7, 47, 7]], dtype=np.int64)
    assert quantize_head(model, BLOCK, accuracy_level=0)
    assert [n.op_type for n in model.graph.node] == ["Gather", "MatMulNBits"]
    assert {i.name for i in model.graph.initializer if i.data_type == TensorProto.FLOAT} == {"embedding",
                                                                                            "head_t_scale"}
    np.testing.assert_allclose(_logits(model, ids), embedding[ids] @ dequantized.T, rtol=1e-4, atol=1e-3)
