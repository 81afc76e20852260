"""GPTQ at 4 bits for an ONNX decoder's MatMul weights: onnxruntime's GPTQ solver and MatMulNBits packing
(``onnxruntime.quantization.neural_compressor.weight_only``), fed Hessians gathered in one pass.

onnxruntime's own driver (MatMulNBitsQuantizer with GPTQWeightOnlyQuantConfig) runs the whole model once per
distinct MatMul input and calibration batch: about 120 inputs at SmolLM2-135M's shape, so 240 full forwards for
two batches. Here one run per sequence returns every MatMul input at once, and each input's Hessian (2/n X^T X)
accumulates from it. Blocks are symmetric (4-bit zero point 8, none stored): onnxruntime packs asymmetric 4-bit
zero points two to a byte across rows and fails where a width is an odd number of blocks.

The LM head is 8-bit, round-to-nearest, as llama.cpp's 4-bit mixes keep it at 6-8 bits: the single largest and
most output-sensitive matrix (at SmolLM2-135M's shape a fifth of the weights; fp32 it held the file at 0.34x the
fp32 graph). A tied embedding's lookup reads the head's blocks (GatherBlockQuantized, models/genai_build), so the
table is stored once, in 8 bits.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import load_external_data_for_model, uses_external_data

from cpuforge.models import onnx_files
from cpuforge.models.genai_build import gather_head_rows
from cpuforge.models.onnx_export import LOGITS

BITS = 4
HEAD_BITS = 8
GPTQ_BLOCK = 128  # columns the solver updates at once (the GPTQ paper's lazy batch), not the quantization block
PERCENT_DAMP = 0.01  # of the mean Hessian diagonal added to it, so the inverse exists


def quantizable_matmuls(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The MatMuls whose second input is a 2-D fp32 weight that no other node reads, but the LM head's."""
    inits = {t.name: t for t in graph.initializer}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    return [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in inits
            and len(inits[n.input[1]].dims) == 2 and inits[n.input[1]].data_type == TensorProto.FLOAT
            and readers[n.input[1]] == 1 and LOGITS not in n.output]


def head_weight(graph: onnx.GraphProto) -> tuple[onnx.NodeProto, np.ndarray, onnx.NodeProto | None] | None:
    """The MatMul that writes the logits, its (in, vocab) fp32 weight, and the Transpose it reads that weight
    through when the table is the embedding's too (None when it reads an initializer directly); None when the
    graph's head is not such a MatMul."""
    inits = {t.name: t for t in graph.initializer}
    producers = {out: n for n in graph.node for out in n.output}
    head = next((n for n in graph.node if n.op_type == "MatMul" and LOGITS in n.output), None)
    if head is None:
        return None
    source = head.input[1]
    if source in inits and len(inits[source].dims) == 2:
        return head, numpy_helper.to_array(inits[source]).astype(np.float32), None
    transpose = producers.get(source)
    if (transpose is not None and transpose.op_type == "Transpose" and transpose.input[0] in inits
            and [list(a.ints) for a in transpose.attribute if a.name == "perm"] in ([[1, 0]], [])
            and len(inits[transpose.input[0]].dims) == 2):
        return head, numpy_helper.to_array(inits[transpose.input[0]]).astype(np.float32).T, transpose
    return None


def int8_codes(weight: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Round-to-nearest symmetric 8-bit codes (N x blocks, block_size; zero point 128) and scales (N x blocks, 1)
    of a (K, N) weight, each column in blocks of ``block_size`` rows (the last padded with zeros)."""
    groups = column_blocks(weight.astype(np.float32), block_size)
    peak = np.abs(groups).max(axis=2, keepdims=True)
    scale = np.where(peak > 0, peak / 127, 1.0).astype(np.float32)
    codes = (np.clip(np.round(groups / scale), -127, 127) + 128).astype(np.uint8)
    return codes.reshape(-1, block_size), scale.reshape(-1, 1)


def column_blocks(weight: np.ndarray, block_size: int) -> np.ndarray:
    """A (K, N) weight as (N, blocks, block_size): each column in blocks of rows, the last padded with zeros
    (MatMulNBits' layout)."""
    k_dim, n_dim = weight.shape
    blocks = -(-k_dim // block_size)
    padded = np.zeros((blocks * block_size, n_dim), weight.dtype)
    padded[:k_dim] = weight
    return padded.T.reshape(n_dim, blocks, block_size)


def tied_lookup(graph: onnx.GraphProto, table: str) -> tuple[list[onnx.NodeProto], str, str] | None:
    """The embedding lookup that reads the head's ``table``, as (its nodes, the token ids, the rows it yields):
    a Gather of the (vocab, width) table's rows, or of the (width, vocab) table's columns followed by the
    Transpose to rows (models/onnx_export.share_tied_embedding's layout); None for neither."""
    gather = next((n for n in graph.node if n.op_type == "Gather" and n.input[0] == table), None)
    if gather is None:
        return None
    axis = next((a.i for a in gather.attribute if a.name == "axis"), 0)
    if axis == 0:
        return [gather], gather.input[1], gather.output[0]
    readers = [n for n in graph.node if gather.output[0] in n.input]
    if axis == 1 and len(readers) == 1 and readers[0].op_type == "Transpose" and \
            [list(a.ints) for a in readers[0].attribute if a.name == "perm"] == [[1, 2, 0]]:
        return [gather, readers[0]], gather.input[1], readers[0].output[0]
    return None


def quantize_head(proto: onnx.ModelProto, block_size: int, accuracy_level: int) -> bool:
    """The LM head as an 8-bit MatMulNBits (round-to-nearest); a tied table's lookup then reads its blocks and
    the fp32 table is dropped. Returns whether the head was quantized."""
    from onnxruntime.quantization.neural_compressor.weight_only import make_matmul_weight_only_node

    graph = proto.graph
    found = head_weight(graph)
    if found is None:
        return False
    head, weight, transpose = found
    table = transpose.input[0] if transpose is not None else head.input[1]
    codes, scales = int8_codes(weight, block_size)
    named = helper.make_node("MatMul", [head.input[0], table], list(head.output), name=head.name)
    replacement, new_inits = make_matmul_weight_only_node(
        node=named, weight_shape=weight.shape, num_bits=HEAD_BITS, group_size=block_size,
        k_blocks=-(-weight.shape[0] // block_size), q_weight=codes, scale=scales, zero_point=None,
        accuracy_level=accuracy_level)
    at = list(graph.node).index(head)
    graph.node.remove(head)
    graph.node.insert(at, replacement)
    graph.initializer.extend(new_inits)
    if transpose is not None and not any(transpose.output[0] in n.input for n in graph.node):
        graph.node.remove(transpose)
    lookup = tied_lookup(graph, table)
    if lookup is not None:
        replaced, ids, rows = lookup
        at = list(graph.node).index(replaced[0])
        for node in replaced:
            graph.node.remove(node)
        for node in reversed(gather_head_rows(graph, replacement, ids, rows, replaced[0].name)):
            graph.node.insert(at, node)
    if not any(table in n.input for n in graph.node):
        graph.initializer.remove(next(t for t in graph.initializer if t.name == table))
    return True


def gather_hessians(proto: onnx.ModelProto, inputs: list[str], batches: Iterable[dict[str, np.ndarray]],
                    work_dir: Path) -> dict[str, np.ndarray]:
    """2/n X^T X (fp32) for each named activation over every calibration batch (the graph's feeds, batch first),
    from one run of the graph per sequence."""
    import onnxruntime as ort

    graph = proto.graph
    graph.output.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in inputs)
    augmented = work_dir / "augmented.onnx"
    try:
        onnx_files.save(proto, augmented, check=False)
        if any(uses_external_data(t) for t in graph.initializer):  # the write moved a large graph's weights out
            load_external_data_for_model(proto, str(work_dir))
    finally:
        del graph.output[len(graph.output) - len(inputs):]
    session = ort.InferenceSession(str(augmented), providers=["CPUExecutionProvider"])
    sums: dict[str, np.ndarray] = {}
    rows = 0
    for batch in batches:
        # a sequence at a time: every matmul input of a 1B model for 4 x 2048 tokens would hold 8.5 GB at once
        for feeds in ({k: v[i:i + 1] for k, v in batch.items()} for i in range(len(next(iter(batch.values()))))):
            values = session.run(inputs, feeds)
            for name, x in zip(inputs, values, strict=True):
                x = x.reshape(-1, x.shape[-1])
                sums[name] = sums[name] + x.T @ x if name in sums else x.T @ x  # fp32: a 1B model's hold 3.9 GB
            rows += values[0].size // values[0].shape[-1]
    if not rows:
        raise ValueError("GPTQ needs at least one calibration batch")
    return {name: s * np.float32(2.0 / rows) for name, s in sums.items()}


def grid_codes(solved: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The 4-bit codes (N x blocks, block_size; zero point 8) and scales (N x blocks, 1), in the layout
    make_matmul_weight_only_node packs, that reproduce the
    solver's output exactly. GPTQ returns weights already on a grid, k * s with k in [-8, 7] for each block of a
    column, but not s: quantizing them again with a scale from their own range (onnxruntime's quant_tensor) lands
    on another grid when the solver's extremes were not hit, and rounds twice. For each block the largest s =
    peak / k (k = 1..8) that makes every value an integer multiple within [-8, 7] is exact."""
    groups = column_blocks(solved.astype(np.float64), block_size)
    peak = np.abs(groups).max(axis=2, keepdims=True)
    scale = np.where(peak > 0, peak / 7, 1.0)  # the solver's usual step: where nothing fits exactly (not seen)
    found = peak == 0
    for k in range(1, 9):
        step = np.where(peak > 0, peak / k, 1.0)
        ratio = groups / step
        fits = (np.abs(ratio - np.round(ratio)) < 1e-3).all(axis=2, keepdims=True)
        fits &= (np.round(ratio) >= -8).all(axis=2, keepdims=True) & (np.round(ratio) <= 7).all(axis=2, keepdims=True)
        take = fits & ~found
        scale = np.where(take, step, scale)
        found |= take
    codes = np.clip(np.round(groups / scale) + 8, 0, 15).astype(np.uint8)
    return codes.reshape(-1, block_size), scale.reshape(-1, 1).astype(np.float32)


def quantize_gptq(proto: onnx.ModelProto, batches: Iterable[dict[str, np.ndarray]], block_size: int = 32,
                  accuracy_level: int = 4, work_dir: Path | None = None) -> int:
    """Replace ``proto``'s quantizable MatMuls (in place; its weights loaded) by MatMulNBits at 4 bits in blocks of
    ``block_size``, each weight solved by GPTQ against the Hessian of its input on ``batches`` (the graph's feeds),
    and the LM head by 8-bit round-to-nearest (quantize_head).
    The graph with its extra outputs is written to a temporary folder in ``work_dir`` (a 1B model's 4.4 GB: put
    it beside the output, not in a small /tmp). Returns how many were replaced."""
    from onnxruntime.quantization.neural_compressor.weight_only import gptq, make_matmul_weight_only_node

    graph = proto.graph
    targets = quantizable_matmuls(graph)
    hessians = {}
    if targets:
        with tempfile.TemporaryDirectory(prefix="cpuforge-gptq-", dir=work_dir) as work:
            hessians = gather_hessians(proto, sorted({n.input[0] for n in targets}), batches, Path(work))
    inits = {t.name: t for t in graph.initializer}
    for node in targets:
        weight = numpy_helper.to_array(inits[node.input[1]]).astype(np.float32)
        solved = gptq(weight.copy(), hessians[node.input[0]].astype(np.float64), num_bits=BITS, group_size=block_size,
                      scheme="sym", blocksize=GPTQ_BLOCK, percdamp=PERCENT_DAMP, actorder=False, mse=False,
                      perchannel=True)
        codes, scales = grid_codes(solved, block_size)
        replacement, new_inits = make_matmul_weight_only_node(
            node=node, weight_shape=weight.shape, num_bits=BITS, group_size=block_size,
            k_blocks=-(-weight.shape[0] // block_size),
            q_weight=codes, scale=scales, zero_point=None, accuracy_level=accuracy_level)
        at = list(graph.node).index(node)
        graph.node.remove(node)
        graph.node.insert(at, replacement)
        graph.initializer.remove(inits.pop(node.input[1]))
        graph.initializer.extend(new_inits)
    head = quantize_head(proto, block_size, accuracy_level)
    if not any(op.domain == "com.microsoft" for op in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return len(targets) + head
