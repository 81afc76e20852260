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
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from cpuforge.models.onnx_export import set_metadata

LM_HEAD = "/lm_head/MatMul"  # the builder's name for the LM head's matmul
PRECISIONS = {"fp32": None, "int8": 8, "int4": 4}


class GenaiBuildError(RuntimeError):
    """The builder refused the folder or failed; the message carries its output."""


def build_decoder(hf_folder: Path, target: Path, precision: str, metadata: dict[str, str],
                  accuracy_level: int | None = None, quantize_lm_head: bool = True,
                  block_size: int = 32) -> dict[str, Any]:
    """Build the graph of the transformers folder ``hf_folder`` at ``precision`` (fp32, int8, int4) into
    the single file ``target`` with ``metadata`` attached; returns the builder's genai_config (its
    decoder filename set to target's name). ``quantize_lm_head=False`` keeps the LM head in fp32."""
    import onnx  # here: runtime.py imports this module for shares_kv_buffer alone

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, not {precision!r}")
    options = []
    if PRECISIONS[precision]:
        options.append(f"block_size={block_size}")
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
        proto = onnx.load(str(out / "model.onnx"))  # with its external weights, saved below in one file
        set_metadata(proto, metadata)
        onnx.save(proto, str(target))
        config = json.loads((out / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = target.name
    return config


def shares_kv_buffer(proto: Any) -> bool:
    """Whether the graph (an onnx.ModelProto) is the builder's kind, whose past and present KV share one buffer."""
    return any(node.op_type == "GroupQueryAttention" for node in proto.graph.node)
