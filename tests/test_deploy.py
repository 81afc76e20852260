"""From a trained model to a deployable one: ONNX export with a KV cache in ONNX Runtime GenAI's layout,
int8 quantization, scoring, loading by path, the champion gate's rule, and clear errors for bad model
files and text."""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import psutil
import pytest
import torch

from cpuforge.models.checkpoint import load_model
from cpuforge.models.onnx_export import META_CONFIG, read_metadata
from cpuforge.models.runtime import (
    ModelLoadError,
    OnnxDecoder,
    TorchDecoder,
    generate,
    left_pad,
    load_language_model,
)
from cpuforge.tasks import stages
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.data import open_shards, token_byte_lengths
from cpuforge.tasks.engine.measure import MeasuringProcess
from cpuforge.tasks.engine.scoring import Score, alternating_speeds, score_text, score_tokens, score_with_choices
from cpuforge.tasks.engine.training_run import run_training
from cpuforge.tasks.infra.store import StageRecord
from cpuforge.tasks.records.errors import DataError
from cpuforge.tasks.release.register import decide
from cpuforge.tasks.stages.quantize import GENAI, choose, confident_agreement, kquant_misfit
from tests.conftest import build_stage
from tests.test_pretrain import shards, spec_for  # noqa: F401  (module fixture)


@pytest.fixture(scope="module")
def trained(shards, tmp_path_factory) -> StageRecord:  # noqa: F811
    out = tmp_path_factory.mktemp("trained")
    run_training(spec_for(shards, out, "train.max_steps=60"))
    return StageRecord(stage="recover", key="r", output_dir=str(out), files={"model": "model"})


@pytest.fixture(scope="module")
def tokenized(shards) -> StageRecord:  # noqa: F811
    return StageRecord(stage="tokenize", key="t", output_dir=str(shards))


@pytest.fixture(scope="module")
def exported(trained, tokenized, tmp_path_factory) -> tuple[StageRecord, dict]:
    out = tmp_path_factory.mktemp("export")
    result = build_stage("export", load_config("tiny"), out, tokenize=tokenized, recover=trained)
    return StageRecord(stage="export", key="e", output_dir=str(out), files=result.files), result.metrics


@pytest.fixture(scope="module")
def quantized(exported, tokenized, trained, tmp_path_factory) -> tuple[StageRecord, dict]:
    out = tmp_path_factory.mktemp("quantize")
    cfg = load_config("tiny", overrides=["quantize.method=best"])  # every candidate family, GenAI's included
    result = build_stage("quantize", cfg, out, tokenize=tokenized, recover=trained, export=exported[0])
    return StageRecord(stage="quantize", key="q", output_dir=str(out), files=result.files), result.metrics


def test_export_matches_pytorch_and_carries_what_generation_needs(exported, trained):
    record, metrics = exported
    assert metrics["parity_max_abs_diff"] < 1e-3 and metrics["parity_argmax_agreement"] > 0.999
    assert metrics["generation_match"] == 1.0
    onnx.checker.check_model(str(record.path("onnx")))
    meta = read_metadata(record.path("onnx"))
    assert {"cpuforge.config", "cpuforge.tokenizer", "cpuforge.eod_id"} <= set(meta)

    model = load_model(trained.path("model"))
    torch_dec, onnx_dec = TorchDecoder(model), OnnxDecoder(record.path("onnx"), model.cfg)
    n = model.cfg.n_layer
    assert [i.name for i in onnx_dec.session.get_inputs()] == [
        "input_ids", "attention_mask", "position_ids",
        *[f"past_key_values.{i}.{kind}" for i in range(n) for kind in ("key", "value")]]
    assert [o.name for o in onnx_dec.session.get_outputs()] == [
        "logits", *[f"present.{i}.{kind}" for i in range(n) for kind in ("key", "value")]]
    # Dynamic batch and sequence: shapes never seen at export time.
    for shape in ((1, 5), (3, 17), (2, model.cfg.block_size)):
        ids = np.random.default_rng(0).integers(0, model.cfg.vocab_size, size=shape)
        assert np.abs(torch_dec.logits(ids) - onnx_dec.logits(ids)).max() < 1e-4
    # The KV cache: prefill then steps, against PyTorch's own cached decoding.
    prompt = [5, 9, 13, 2]
    assert list(generate(onnx_dec, prompt, 20)) == list(generate(torch_dec, prompt, 20))
    gen = torch.Generator().manual_seed(0)
    sampled = list(generate(onnx_dec, prompt, 20, temperature=1.0, top_k=10, generator=gen))
    assert len(sampled) == 20 and all(0 <= t < model.cfg.vocab_size for t in sampled)


def test_export_and_quantize_folders_are_onnx_runtime_genai_folders(exported, quantized, trained):
    cfg = load_model(trained.path("model")).cfg
    for record, graph in ((exported[0], "model.onnx"), (quantized[0], "model.int8.onnx")):
        folder = Path(record.output_dir)
        config = json.loads((folder / "genai_config.json").read_text())
        model, decoder = config["model"], config["model"]["decoder"]
        assert model["type"] == "llama" and decoder["filename"] == graph and (folder / graph).is_file()
        assert (model["context_length"], model["vocab_size"]) == (cfg.block_size, cfg.vocab_size)
        assert (decoder["num_hidden_layers"], decoder["num_attention_heads"], decoder["num_key_value_heads"],
                decoder["head_size"], decoder["hidden_size"]) == (cfg.n_layer, cfg.n_head, cfg.n_kv_head,
                                                                  cfg.head_dim, cfg.d_model)
        assert decoder["inputs"]["past_key_names"] == "past_key_values.%d.key"
        assert decoder["outputs"]["present_value_names"] == "present.%d.value"
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        lm = load_language_model(folder)  # cpuforge reads the folder too: the graph genai_config names
        assert lm.path == folder / graph
        assert tokenizer_config["eos_token"] == lm.tokenizer.id_to_token(model["eos_token_id"])
        assert model["eos_token_id"] == lm.eod_id


def _genai_greedy(og, model, prompts: list[list[int]], max_new_tokens: int, eos: int
                  ) -> tuple[list[list[int]], list[np.ndarray]]:
    """GenAI's greedy continuation of each prompt, as one batch, and its logits at every step."""
    batch, width = len(prompts), max(len(p) for p in prompts)
    tokens = np.full((batch, width), eos, dtype=np.int32)  # padded on the right, as GenAI's encode_batch does
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = prompt
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=width + max_new_tokens, batch_size=batch)
    generator = og.Generator(model, params)
    generator.append_tokens(tokens)
    steps = []
    while not generator.is_done():
        steps.append(np.asarray(generator.get_logits()).reshape(batch, -1))
        generator.generate_next_token()
    out = []
    for row in range(batch):
        new = [int(t) for t in generator.get_sequence(row)][width:]
        out.append(new[:new.index(eos)] if eos in new else new)  # GenAI keeps the end token; cpuforge stops before it
    return out, steps


@pytest.mark.parametrize("stage", [spec.name for spec in stages.PIPELINE if "onnx" in spec.provides])
def test_onnx_runtime_genai_generates_cpuforge_greedy_tokens(stage, exported, quantized):
    import onnxruntime_genai as og

    folder = Path({"export": exported, "quantize": quantized}[stage][0].output_dir)  # each ONNX stage's fixture
    lm = load_language_model(folder)
    model = og.Model(str(folder))
    tokenizer = og.Tokenizer(model)
    for text in ("The model", "def main():\n    return x  # done", "Tabs\tand  spaces, caf\u00e9 \u2014 \u00fcber"):
        prompt = lm.encode(text)
        assert [int(t) for t in tokenizer.encode(text)] == prompt  # GenAI reads the byte-level BPE as cpuforge does
        ours = list(generate(lm.decoder, prompt, 24, temperature=0.0, stop_token=lm.eod_id))
        (theirs,), steps = _genai_greedy(og, model, [prompt], 24, lm.eod_id)
        assert theirs == ours and ours
        assert tokenizer.decode(theirs) == lm.tokenizer.decode(ours)
        if stage == "export":  # fp32: GenAI's logits with its KV cache are the plain forward pass's
            for i, got in enumerate(steps):
                expected = lm.decoder.logits(np.array([prompt + ours[:i]]))[0, -1]
                assert np.abs(got[0] - expected).max() < 1e-4


def test_onnx_runtime_genai_batches_prompts_of_different_lengths(exported):
    import onnxruntime_genai as og

    folder = Path(exported[0].output_dir)
    lm = load_language_model(folder)
    model = og.Model(str(folder))
    prompts = [lm.encode("The model reads text and learns to predict"), lm.encode("A cat")]
    together, steps = _genai_greedy(og, model, prompts, 12, lm.eod_id)
    for row, prompt in enumerate(prompts):
        assert together[row] == list(generate(lm.decoder, prompt, 12, temperature=0.0, stop_token=lm.eod_id))
        assert np.abs(steps[0][row] - lm.decoder.logits(np.array([prompt]))[0, -1]).max() < 1e-4


def test_left_padded_batch_gives_each_prompt_its_own_logits(exported):
    lm = load_language_model(exported[0].path("onnx"))
    decoder = lm.decoder
    long, short = lm.encode("The model reads text and learns to predict"), lm.encode("A cat")
    assert len(long) > len(short) + 3
    ids, mask, positions = left_pad([long, short], lm.eod_id)
    assert mask[1, 0] == 0 and positions[1, -1] == len(short) - 1
    logits, cache = decoder.forward(ids, attention_mask=mask, position_ids=positions)
    assert np.isfinite(logits).all()  # padding queries see nothing, and still give no NaN
    alone = [decoder.forward(np.array([p]))[0] for p in (long, short)]
    for row in range(2):
        assert np.abs(logits[row, -1] - alone[row][0, -1]).max() < 1e-4
    # One decoding step on the padded cache: the mask grows by the new slot, positions go on per row.
    nxt = np.array([[int(a[0, -1].argmax())] for a in alone])
    stepped, _ = decoder.forward(nxt, cache, np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1),
                                 np.array([[len(long)], [len(short)]]))
    for row, prompt in enumerate((long, short)):
        reference = decoder.logits(np.array([prompt + [int(nxt[row, 0])]]))[0, -1]
        assert np.abs(stepped[row, -1] - reference).max() < 1e-4


def test_model_builder_graph_decodes_the_exports_greedy_tokens(trained, exported, tmp_path):
    """ONNX Runtime GenAI's builder on the recovered transformers folder: a fused graph (GroupQueryAttention,
    no position_ids) that cpuforge's runtime loads and decodes, its shared KV buffer under I/O binding, as the
    export does with its plain path."""
    from cpuforge.models.genai_build import build_decoder

    export_path = exported[0].path("onnx")
    config = build_decoder(trained.path("model"), tmp_path / "fused.onnx", "fp32", read_metadata(export_path))
    assert config["search"]["past_present_share_buffer"] and config["model"]["decoder"]["filename"] == "fused.onnx"
    fused, ours = load_language_model(tmp_path / "fused.onnx"), load_language_model(export_path)
    assert fused.decoder.shared_kv and not ours.decoder.shared_kv
    assert "position_ids" not in fused.decoder.inputs
    assert {n.op_type for n in onnx.load(str(tmp_path / "fused.onnx")).graph.node} >= {
        "GroupQueryAttention", "SkipSimplifiedLayerNormalization"}
    ids = np.random.default_rng(1).integers(0, fused.cfg.vocab_size, size=(2, fused.cfg.block_size))
    assert np.abs(fused.decoder.logits(ids) - ours.decoder.logits(ids)).max() < 1e-4
    prompt = [5, 9, 13, 2]
    steps = list(generate(fused.decoder, prompt, fused.cfg.block_size))  # to the end of the context
    assert steps == list(generate(ours.decoder, prompt, fused.cfg.block_size))
    # Each step's logits are the plain forward pass's over the whole sequence so far.
    logits, cache = fused.decoder.prefill(np.array([prompt]))
    for i, token in enumerate(steps[:8]):
        logits, cache = fused.decoder.step(np.array([[token]]), cache, len(prompt) + i)
        expected = ours.decoder.logits(np.array([prompt + steps[:i + 1]]))[0, -1]
        assert np.abs(logits[0] - expected).max() < 1e-4
    with pytest.raises(ValueError, match="shared buffer"):  # a past copied in and out: not this graph's way
        fused.decoder.forward(np.array([[1]]), past=[np.zeros((1, 2, 3, 4), np.float32)])


def test_a_prompts_prefill_computes_the_last_positions_logits_alone(exported, quantized):
    """Generation reads the logits of a prompt's last position: every ONNX graph (the export, the builder's, each
    quantized candidate) takes transformers' logits_to_keep and its prefill computes that one row, the full
    pass's last; unfed, the graph gives every position's, which scoring and ONNX Runtime GenAI read."""
    candidates = sorted((Path(quantized[0].output_dir) / "candidates").glob("*.onnx"))
    assert len(candidates) >= 5
    for path in [exported[0].path("onnx"), *candidates]:
        lm = load_language_model(path)
        assert lm.decoder.keeps_last, path.name
        ids = np.random.default_rng(3).integers(0, lm.cfg.vocab_size, size=(2, 24))
        full = lm.decoder.logits(ids)
        assert full.shape == (2, 24, lm.cfg.vocab_size)
        last, _ = lm.decoder.prefill(ids)
        # Dynamic int8 quantizes the head's input per tensor: one row gets its own scale, a hair from the batch's.
        tolerance = 0.02 * np.ptp(full) if "dynamic" in path.name or "static" in path.name else 1e-4
        assert np.abs(last - full[:, -1]).max() < tolerance, path.name
        if not lm.decoder.shared_kv:
            kept, _ = lm.decoder.forward(ids, last_only=True)
            assert kept.shape == (2, 1, lm.cfg.vocab_size)


def test_model_builder_int8_candidate_in_blocks_of_64_shares_its_head_and_matches_blocks_of_32(quantized):
    """genai-int8-b64 is the int8 graph with 64-wide blocks everywhere, its embedding lookup included, and
    as accurate as blocks of 32: only the scales per row differ."""
    record, metrics = quantized
    folder = Path(record.output_dir) / "candidates"
    proto = onnx.load(str(folder / "genai-int8-b64.onnx"))
    blocks = {onnx.helper.get_attribute_value(a) for n in proto.graph.node
              if n.op_type in ("MatMulNBits", "GatherBlockQuantized") for a in n.attribute if a.name == "block_size"}
    assert blocks == {64}
    assert "GatherBlockQuantized" in {n.op_type for n in proto.graph.node}  # no fp32 table beside the int8 head
    assert "block 64" in read_metadata(folder / "genai-int8-b64.onnx")["cpuforge.quantization"]
    assert metrics["genai-int8-b64/val_bpb"] == pytest.approx(metrics["genai-int8/val_bpb"], rel=0.01)
    assert metrics["genai-int8-b64/token_agreement"] >= 0.9
    wide, narrow = (load_language_model(folder / f"{name}.onnx") for name in ("genai-int8-b64", "genai-int8"))
    ids = np.random.default_rng(2).integers(0, wide.cfg.vocab_size, size=(2, wide.cfg.block_size))
    expected = narrow.decoder.logits(ids)
    assert np.abs(wide.decoder.logits(ids) - expected).max() < 0.05 * np.ptp(expected)


def test_model_builder_int4_candidate_is_4_bit_and_says_so(quantized):
    record, metrics = quantized
    folder = Path(record.output_dir) / "candidates"
    meta = read_metadata(folder / "genai-int4.onnx")
    assert "int4" in meta["cpuforge.quantization"] and "cpuforge.config" in meta
    ops = {n.op_type: n for n in onnx.load(str(folder / "genai-int4.onnx")).graph.node}
    bits = {a.name: a.i for a in ops["MatMulNBits"].attribute}
    assert bits["bits"] == 4 and bits["accuracy_level"] == 4
    head = [n for n in onnx.load(str(folder / "genai-int4-fp32head.onnx")).graph.node if "lm_head" in n.name]
    assert [n.op_type for n in head] == ["MatMul"]  # the LM head left in fp32
    # genai-int4-head8: llama.cpp Q4_0's mix, every matmul 4-bit but the LM head's 8 bits
    mix = {n.name: {a.name: a.i for a in n.attribute}
           for n in onnx.load(str(folder / "genai-int4-head8.onnx")).graph.node if n.op_type == "MatMulNBits"}
    assert [attrs["bits"] for name, attrs in mix.items() if "lm_head" in name] == [8]
    assert {attrs["bits"] for name, attrs in mix.items() if "lm_head" not in name} == {4}
    assert "LM head int8" in read_metadata(folder / "genai-int4-head8.onnx")["cpuforge.quantization"]
    assert {"genai-int4/token_agreement", "genai-int8/val_bpb"} <= set(metrics)
    assert metrics["weight_bits"] in (4, 8)


def test_k_quant_candidates_are_4_bit_with_their_head_as_named_and_scored_against_fp32(quantized):
    """genai-int4-kquant is 4-bit throughout with k-quant scales; -head8 keeps the LM head at 8 bits and the
    lookup reads that head (no fp32 table); every candidate carries its KL to fp32, which is small, and zero for
    fp32 itself."""
    record, metrics = quantized
    folder = Path(record.output_dir) / "candidates"
    for name, head_bits in (("genai-int4-kquant", 4), ("genai-int4-kquant-head8", 8)):
        proto = onnx.load(str(folder / f"{name}.onnx"))
        bits = {n.name: {a.name: a.i for a in n.attribute}["bits"] for n in proto.graph.node
                if n.op_type in ("MatMulNBits", "GatherBlockQuantized")}
        head = next(b for n, b in bits.items() if "lm_head" in n)
        assert head == head_bits and {b for n, b in bits.items() if "layers" in n} == {4}
        assert not [i for i in proto.graph.initializer if len(i.dims) == 2 and i.data_type == onnx.TensorProto.FLOAT
                    and i.dims[0] >= 256 and "scale" not in i.name]  # no fp32 matrix or table left
        assert "k-quant" in read_metadata(folder / f"{name}.onnx")["cpuforge.quantization"]
        assert 0 < metrics[f"{name}/kl_to_fp32"] < 0.5
    assert metrics["fp32/kl_to_fp32"] == 0.0 and "kl_to_fp32" in metrics
    # 8-bit weights move the distribution less than 4-bit ones
    assert metrics["genai-int8/kl_to_fp32"] < metrics["genai-int4/kl_to_fp32"]


def test_gptq_candidate_is_4_bit_with_an_8_bit_head_the_lookup_shares(quantized, exported):
    """GPTQ int4 replaces every layer matmul of the exported graph with 4-bit MatMulNBits and the tied LM head
    with an 8-bit one whose blocks the lookup reads: no fp32 matrix or table is left. It is scored against fp32
    like the rest and generates."""
    record, metrics = quantized
    path = Path(record.output_dir) / "candidates" / "gptq-int4.onnx"
    proto = onnx.load(str(path))
    bits = {n.name: {a.name: a.i for a in n.attribute}["bits"] for n in proto.graph.node
            if n.op_type in ("MatMulNBits", "GatherBlockQuantized")}
    head = next(n for n in proto.graph.node if n.op_type == "MatMulNBits" and "logits" in n.output)
    vocab = {a.name: a.i for a in head.attribute}["N"]
    assert not [i.name for i in proto.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and vocab in i.dims
                and not i.name.endswith("_scale")]
    assert not [n for n in proto.graph.node if n.op_type in ("MatMul", "Gather")]  # no fp32 matmul or lookup left
    lookup = next(n for n in proto.graph.node if n.op_type == "GatherBlockQuantized")
    assert bits[head.name] == 8 and bits[lookup.name] == 8
    exported_matmuls = [n for n in onnx.load(str(exported[0].path("onnx"))).graph.node if n.op_type == "MatMul"]
    assert sorted(bits.values()) == [4] * (len(exported_matmuls) - 1) + [8, 8]  # every layer matmul at 4 bits
    assert "GPTQ" in read_metadata(path)["cpuforge.quantization"]
    assert metrics["gptq-int4/val_bpb"] <= metrics["fp32/val_bpb"] * 1.02 and 0 < metrics["gptq-int4/kl_to_fp32"] < 0.5
    assert path.stat().st_size < 0.25 * Path(exported[0].path("onnx")).stat().st_size
    lm = load_language_model(path)
    assert len(list(generate(lm.decoder, lm.tokenizer.encode("The ").ids, 4))) == 4


def test_gptq_codes_reproduce_the_solvers_weights_exactly():
    """onnxruntime's GPTQ solver returns weights on a 4-bit grid without its scales: the codes and scales packed
    are the ones that give back those very weights (quantizing them again would round twice)."""
    from onnxruntime.quantization.neural_compressor.weight_only import gptq

    from cpuforge.models.gptq_onnx import grid_codes

    rng = np.random.default_rng(0)
    weight = rng.normal(0, 0.05, (80, 24)).astype(np.float32)  # 80 rows: two whole blocks of 32 and a part
    x = rng.normal(0, 1, (256, 80))
    solved = gptq(weight.copy(), 2 / 256 * x.T @ x, num_bits=4, group_size=32, scheme="sym", blocksize=128,
                  percdamp=0.01, actorder=False, mse=False, perchannel=True)
    codes, scales = grid_codes(solved, 32)
    assert codes.shape == (24 * 3, 32) and codes.max() <= 15 and scales.shape == (24 * 3, 1)
    back = ((codes.astype(np.float64) - 8) * scales).reshape(24, 3 * 32).T[:80]
    np.testing.assert_allclose(back, solved, rtol=1e-5, atol=1e-7)
    assert not np.allclose(solved, weight, atol=1e-4)  # it did quantize

    # packed as onnxruntime's MatMulNBits reads them: a one-matmul graph computes x @ solved
    import onnxruntime as ort
    from onnx import TensorProto, helper
    from onnxruntime.quantization.neural_compressor.weight_only import make_matmul_weight_only_node

    matmul = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    node, inits = make_matmul_weight_only_node(node=matmul, weight_shape=weight.shape, num_bits=4, group_size=32,
                                               k_blocks=3, q_weight=codes, scale=scales, zero_point=None)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 80])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 24])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    xs = x[:8].astype(np.float32)
    out = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": xs})[0]
    np.testing.assert_allclose(out, xs @ solved.astype(np.float32), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hidden, mlp, odd", [(96, 128, "96"), (576, 736, "736"), (576, 1536, None)])
def test_k_quant_is_not_a_candidate_where_a_width_is_an_odd_number_of_blocks(tmp_path, hidden, mlp, odd):
    """onnxruntime's k-quant fails on an odd number of 32-blocks (a pruned demo's 96, SmolLM2 pruned to 736):
    known from the shape, before building; round-to-nearest int4 is unaffected."""
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": hidden, "intermediate_size": mlp,
                                                      "num_attention_heads": hidden // 32, "head_dim": 32}))
    why = kquant_misfit(GENAI["genai-int4-kquant"], tmp_path)
    assert (why is None) if odd is None else (f"this model has {odd}" in why)
    assert kquant_misfit(GENAI["genai-int4"], tmp_path) is None


def test_model_builder_int8_candidate_reads_its_embedding_from_the_int8_head(quantized, tmp_path):
    """The builder's int8 graph keeps no fp32 embedding table beside its int8 LM head: the lookup reads the
    head's 8-bit blocks (GatherBlockQuantized), and ONNX Runtime GenAI generates what cpuforge does with it."""
    import onnxruntime_genai as og

    record, metrics = quantized
    folder = Path(record.output_dir) / "candidates"
    proto = onnx.load(str(folder / "genai-int8.onnx"))
    lookup = [n for n in proto.graph.node if n.output[0] == "/model/embed_tokens/Gather/output_0"]
    assert [n.op_type for n in lookup] == ["GatherBlockQuantized"]
    assert {a.name: a.i for a in lookup[0].attribute}["bits"] == 8
    cfg = load_language_model(folder / "genai-int8.onnx").cfg
    fp32_tables = [i for i in proto.graph.initializer
                   if i.data_type == onnx.TensorProto.FLOAT and int(np.prod(i.dims)) == cfg.vocab_size * cfg.d_model]
    assert not fp32_tables
    # smaller than the fp32-head variant, which shares one fp32 table between the lookup and the head
    assert metrics["genai-int8/file_bytes"] < metrics["genai-int8-fp32head/file_bytes"]
    assert metrics["genai-int8/val_bpb"] == pytest.approx(metrics["fp32/val_bpb"], rel=0.02)

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(record.output_dir) / name, tmp_path / name)
    shutil.copy(folder / "genai-int8.onnx", tmp_path / "genai-int8.onnx")
    shutil.copy(folder / "genai-int8.genai_config.json", tmp_path / "genai_config.json")
    lm = load_language_model(tmp_path)
    prompt = lm.encode("def main():\n    return")
    ours = list(generate(lm.decoder, prompt, 16, temperature=0.0, stop_token=lm.eod_id))
    (theirs,), _ = _genai_greedy(og, og.Model(str(tmp_path)), [prompt], 16, lm.eod_id)
    assert theirs == ours and ours


def test_tied_embedding_is_stored_once(exported, trained):
    record, _ = exported
    cfg = load_model(trained.path("model")).cfg
    table = cfg.vocab_size * cfg.d_model
    sizes = [int(np.prod(i.dims)) for i in onnx.load(str(record.path("onnx"))).graph.initializer]
    assert sizes.count(table) == 1


def test_int8_model_is_smaller_keeps_quality_and_still_generates(quantized, exported, tokenized):
    record, metrics = quantized
    kept_name = json.loads((Path(record.output_dir) / "candidates.json").read_text())["kept"]
    # tiny: norms and the tokenizer weigh more than at demo scale; a builder candidate with an fp32 LM head
    # keeps the tied table in fp32 (which candidate wins depends on the CPU: measured, not assumed)
    assert metrics["size_ratio"] > (1.5 if kept_name.endswith("fp32head") else 2.5), kept_name
    assert metrics["bpb_increase_pct"] < 2.0
    assert {"dynamic-qint8/val_bpb", "dynamic-quint8/val_bpb", "static-qdq/val_bpb"} <= set(metrics)
    kept = (Path(record.output_dir) / "model.int8.onnx").read_bytes()
    assert any(kept == p.read_bytes() for p in (Path(record.output_dir) / "candidates").glob("*.onnx"))
    report = (Path(record.output_dir) / "quantize_report.md").read_text()
    assert "| fp32 |" in report and "where fp32 is confident" in report
    assert 0 < metrics["confident_share"] <= 1 and 0 <= metrics["confident_agreement"] <= 1
    lm = load_language_model(record.path("onnx"))
    assert lm.kind == "onnx" and lm.file_bytes == metrics["int8_bytes"]
    text = "".join(lm.stream("The model", 12, temperature=0.0))
    assert isinstance(text, str)
    fp32 = load_language_model(exported[0].path("onnx"))
    shards = open_shards(Path(tokenized.output_dir), lm.cfg.block_size)
    val = np.asarray(shards.val[:2049])
    lengths = token_byte_lengths(shards.tokenizer_path)
    assert score_tokens(lm, val, lengths).val_bpb == pytest.approx(score_tokens(fp32, val, lengths).val_bpb, rel=0.02)


def test_quantize_reruns_over_an_interrupted_attempt(exported, tokenized, trained, tmp_path):
    leftover = tmp_path / "candidates" / "static-qdq.onnx"
    leftover.parent.mkdir()
    leftover.write_bytes(b"half-written")  # what a kill during quantize_one leaves
    cfg = load_config("tiny", overrides=["quantize.method=dynamic", "quantize.weight_type=qint8"])
    result = build_stage("quantize", cfg, tmp_path, tokenize=tokenized, recover=trained, export=exported[0])
    assert sorted(p.name for p in (tmp_path / "candidates").iterdir()) == ["dynamic-qint8.onnx"]
    assert result.metrics["rule_rounds"] >= 3 and "dynamic-qint8/decode_tok_s" in result.metrics


def test_a_build_budget_builds_the_likeliest_winner_and_lists_the_rest(exported, tokenized, trained, tmp_path):
    from cpuforge.tasks.stages.quantize import BUILD_ORDER, candidate_methods

    cfg = load_config("tiny", overrides=["quantize.method=best", "quantize.build_seconds=0.01"])
    result = build_stage("quantize", cfg, tmp_path, tokenize=tokenized, recover=trained, export=exported[0])
    first = BUILD_ORDER[0]  # always built: there must be a model to keep
    assert result.info["kept"] == first and (tmp_path / "candidates" / f"{first}.onnx").exists()
    left = result.info["skipped_candidates"]
    assert set(left) == set(candidate_methods(cfg.quantize)) - {first}
    assert all("quantize.build_seconds=0.01 s would be passed" in why or "k-quant" in why for why in left.values())
    assert result.metrics["candidates_built"] == 1 and result.metrics["candidates_skipped"] == len(left)
    report = (tmp_path / "quantize_report.md").read_text()
    assert report.count("not built: quantize.build_seconds") == 1  # one line names them all
    assert all(f"**{name}**" in report.split("left out: ")[1] for name in left)


def test_a_model_the_builder_refuses_keeps_the_other_candidates(exported, tokenized, trained, tmp_path, monkeypatch):
    """GenAI's model builder refused a pruned model that transformers could not load, and the whole run failed."""
    import cpuforge.tasks.stages.quantize as quantize
    from cpuforge.models.genai_build import GenaiBuildError

    def refuse(hf_folder, *args, **kwargs):
        raise GenaiBuildError(f"onnxruntime_genai's builder failed on {hf_folder}:\nTraceback ...\n"
                              "    ValueError: The hidden size (112) is not a multiple of the number of attention heads (3).")

    monkeypatch.setattr(quantize, "build_decoder", refuse)
    cfg = load_config("tiny", overrides=["quantize.method=best", "quantize.weight_type=qint8"])
    result = build_stage("quantize", cfg, tmp_path, tokenize=tokenized, recover=trained, export=exported[0])
    assert result.info["kept"] in ("dynamic-qint8", "gptq-int4", "static-qdq")  # the families the builder is not
    assert set(result.info["skipped_candidates"]) == set(quantize.GENAI)
    assert "hidden size (112)" in (tmp_path / "quantize_report.md").read_text()
    only_genai = load_config("tiny", overrides=["quantize.method=genai"])  # nothing left to keep: the error stands
    with pytest.raises(GenaiBuildError, match="hidden size"):
        build_stage("quantize", only_genai, tmp_path / "genai", tokenize=tokenized, recover=trained,
                    export=exported[0])


def test_scores_agree_across_formats_and_match_a_direct_computation(trained, exported, tokenized):
    torch_lm = load_language_model(Path(trained.output_dir))  # a stage folder resolves to its model/
    onnx_lm = load_language_model(exported[0].path("onnx"))
    shards = open_shards(Path(tokenized.output_dir), 64)
    tokens = np.asarray(shards.val[:300])  # 4 full windows and a partial one
    lengths = token_byte_lengths(shards.tokenizer_path)
    got = score_tokens(torch_lm, tokens, lengths)
    model = load_model(trained.path("model"))
    nll = 0.0
    with torch.no_grad():
        for start in range(0, 299, 64):
            x = torch.from_numpy(tokens[start:min(start + 64, 299)].astype(np.int64))[None]
            y = torch.from_numpy(tokens[start + 1:min(start + 65, 300)].astype(np.int64))[None]
            nll += torch.nn.functional.cross_entropy(model(x)[0][0], y[0], reduction="sum").item()
    assert got.tokens == 299 and got.bytes == int(lengths[tokens[1:]].sum())
    assert got.val_bpb == pytest.approx(nll / np.log(2) / got.bytes, rel=1e-4)
    assert score_tokens(onnx_lm, tokens, lengths).val_bpb == pytest.approx(got.val_bpb, rel=1e-4)
    text = "The model reads text and learns to predict the next token.\n" * 10
    assert score_text(torch_lm, text).val_bpb == pytest.approx(score_text(onnx_lm, text).val_bpb, rel=1e-4)
    with pytest.raises(DataError, match="empty"):
        score_text(torch_lm, "  \n")


def test_bad_model_files_say_what_is_wrong(exported, trained, tmp_path):
    with pytest.raises(ModelLoadError, match="model not found"):
        load_language_model(tmp_path / "nope")
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(exported[0].path("onnx").read_bytes()[:4000])
    with pytest.raises(ModelLoadError, match="not a readable ONNX model"):
        load_language_model(truncated)
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(trained.path("model"), no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        load_language_model(no_tokenizer)
    foreign = onnx.load(str(exported[0].path("onnx")))
    del foreign.metadata_props[:]
    onnx.save(foreign, str(tmp_path / "foreign.onnx"))
    with pytest.raises(ModelLoadError, match=f"no {META_CONFIG}"):
        load_language_model(tmp_path / "foreign.onnx")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="holds no model"):
        load_language_model(tmp_path / "empty")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(trained.path("model"), corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError):
        load_language_model(corrupt)
    lm = load_language_model(trained.path("model"))
    with pytest.raises(ValueError, match="context is 64 tokens"):
        list(lm.stream("word " * 200, 5))


def _speeds(prefill: float, decode: float, jitter: float = 0.0, rounds: int = 3) -> dict[str, list[float]]:
    """Made-up rounds: the best is the given figure, the others `jitter` (relative) below it."""
    return {"prefill_b1": [prefill] + [prefill * (1 - jitter)] * (rounds - 1),
            "decode": [decode] + [decode * (1 - jitter)] * (rounds - 1)}


def test_quantize_rule_keeps_quality_then_never_a_slower_decoder():
    fp32 = _speeds(1000.0, 3500.0)
    quality = {"dynamic-qint8": 2.00, "dynamic-quint8": 2.01, "static-qdq": 2.005}
    speeds = {"fp32": fp32, "dynamic-qint8": _speeds(1100.0, 3600.0), "dynamic-quint8": _speeds(1050.0, 3700.0),
              "static-qdq": _speeds(4200.0, 990.0)}  # the fastest prefill, but decodes at a third of fp32
    decision = choose(quality, speeds, fp32_bpb=2.0, max_increase=0.01)
    assert decision.kept == "dynamic-qint8" and decision.settled and not decision.decodes_slower_than_fp32
    assert decision.margins["decode_vs_fp32_pct"] > 0
    # Quality first: quint8 drops out at 0.1%, static would be the only one left and decodes slower.
    only_static = choose({**quality, "dynamic-qint8": 2.3}, speeds, fp32_bpb=2.0, max_increase=0.003)
    assert only_static.kept == "static-qdq" and only_static.decodes_slower_than_fp32
    assert "fp32 model is faster" in only_static.why
    # Nothing within the quality limit: the most accurate, whatever its speed.
    worst = choose({"dynamic-qint8": 2.5, "static-qdq": 2.3}, speeds, fp32_bpb=2.0, max_increase=0.01)
    assert worst.kept == "static-qdq" and "most accurate" in worst.why


def test_quantize_rule_refuses_a_candidate_whose_greedy_tokens_disagree():
    fp32 = _speeds(1000.0, 3000.0)
    speeds = {"fp32": fp32, "dynamic-qint8": _speeds(1100.0, 3300.0), "genai-int4": _speeds(1200.0, 6000.0)}
    quality = {"dynamic-qint8": 2.0, "genai-int4": 2.01}
    agreeing = choose(quality, speeds, 2.0, 0.01, {"dynamic-qint8": 0.99, "genai-int4": 0.985}, 0.98)
    assert agreeing.kept == "genai-int4"  # both pass: the faster decoder wins
    refused = choose(quality, speeds, 2.0, 0.01, {"dynamic-qint8": 0.99, "genai-int4": 0.95}, 0.98)
    assert refused.kept == "dynamic-qint8" and "greedy tokens" in refused.why


def test_quantize_favour_decode_keeps_the_fastest_generator():
    """Like the README run's figures: dynamic int8 prefills faster, the builder's int8 decodes 1.8x faster."""
    fp32 = _speeds(20000.0, 1230.0)
    speeds = {"fp32": fp32, "dynamic-qint8": _speeds(16400.0, 1300.0), "genai-int8-fp32head": _speeds(8000.0, 2390.0)}
    quality = {"dynamic-qint8": 2.0, "genai-int8-fp32head": 2.0}
    assert choose(quality, speeds, 2.0, 0.01).kept == "dynamic-qint8"  # balanced: 0.93x against 0.88x
    for_generation = choose(quality, speeds, 2.0, 0.01, favour="decode")
    assert for_generation.kept == "genai-int8-fp32head" and "decode speed-up" in for_generation.why
    assert for_generation.margins["score"] == pytest.approx(2390 / 1230, rel=1e-3)
    assert choose(quality, speeds, 2.0, 0.01, favour="prefill").kept == "dynamic-qint8"
    # Favouring prefill never keeps a candidate that decodes slower than fp32.
    slow = {**speeds, "static-qdq": _speeds(40000.0, 600.0)}
    assert choose({**quality, "static-qdq": 2.0}, slow, 2.0, 0.01, favour="prefill").kept == "dynamic-qint8"


def test_quantize_rule_gives_ties_to_the_simpler_candidate():
    fp32 = _speeds(1000.0, 3000.0, jitter=0.002)
    same = _speeds(1500.0, 3300.0, jitter=0.002)
    speeds = {"fp32": fp32, "static-qdq": same, "dynamic-quint8": same, "dynamic-qint8": _speeds(1497.0, 3300.0, 0.002)}
    quality = {"static-qdq": 2.0, "dynamic-quint8": 2.0, "dynamic-qint8": 2.0}
    decision = choose(quality, speeds, fp32_bpb=2.0, max_increase=0.01)
    assert decision.kept == "dynamic-qint8" and not decision.settled  # 0.1% apart with a 0.2% spread: a tie
    assert choose({"static-qdq": 2.0, "dynamic-quint8": 2.0}, speeds, 2.0, 0.01).kept == "dynamic-quint8"


def test_quantize_rule_asks_for_more_rounds_while_the_lead_is_within_the_noise():
    quality = {"dynamic-qint8": 2.0, "static-qdq": 2.0}
    fp32 = _speeds(1000.0, 3000.0, jitter=0.01)
    close = {"fp32": fp32, "dynamic-qint8": _speeds(1100.0, 3300.0, jitter=0.05),
             "static-qdq": _speeds(1130.0, 3330.0, jitter=0.05)}  # a 2% lead against a 5% spread
    noisy = choose(quality, close, 2.0, 0.01)
    assert not noisy.settled and noisy.kept == "dynamic-qint8" and noisy.margins["lead_pct"] < noisy.margins["noise_pct"]
    steady = {**close, "static-qdq": _speeds(1130.0, 3330.0, jitter=0.005),
              "dynamic-qint8": _speeds(1100.0, 3300.0, jitter=0.005)}
    decided = choose(quality, steady, 2.0, 0.01)
    assert decided.settled and decided.kept == "static-qdq"
    # A decode margin over fp32 inside the noise is not settled either: one more round could flip it.
    borderline = {**steady, "dynamic-qint8": _speeds(1100.0, 3010.0, jitter=0.02)}
    assert not choose(quality, borderline, 2.0, 0.01).settled


class _FakeDecoder:
    """Records which model each full-context prefill (the timed kind; decode's prompts are 16 tokens) went to;
    no arithmetic."""

    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls
        self.cfg = SimpleNamespace(block_size=32, vocab_size=10)

    def logits(self, ids):
        return np.zeros((*np.shape(ids), 10), dtype=np.float32)

    def prefill(self, ids):
        if np.shape(ids)[1] == self.cfg.block_size:
            self.calls.append(self.name)
        return np.zeros((len(ids), 10), dtype=np.float32), None

    def step(self, ids, cache, position):
        return np.zeros((1, 10), dtype=np.float32), None


def test_speeds_are_measured_in_alternation_and_rounds_go_on_until_settled():
    calls: list[str] = []
    lms = {n: SimpleNamespace(decoder=_FakeDecoder(n, calls), cfg=SimpleNamespace(block_size=32, vocab_size=10))
           for n in ("fp32", "a", "b")}
    samples = alternating_speeds(lms, [1], decode_tokens=4, min_rounds=2, max_rounds=6, settled=lambda s: False)
    assert all(len(s["decode"]) == 6 and len(s["prefill_b1"]) == 6 for s in samples.values())
    timed = calls[3:]  # after one warm-up call each, rounds of 3 prefill passes per model
    rounds = [[timed[i] for i in range(start, start + 9, 3)] for start in range(0, len(timed), 9)]
    assert rounds[0] == ["fp32", "a", "b"] and rounds[1] == ["a", "b", "fp32"]  # each round visits all, rotated
    assert all(sorted(r) == ["a", "b", "fp32"] for r in rounds)
    calls.clear()
    quick = alternating_speeds(lms, [1], decode_tokens=4, min_rounds=2, max_rounds=6, settled=lambda s: True)
    assert len(quick["a"]["decode"]) == 2
    # a time cap: past min_rounds, no round starts that would end past it, settled or not
    capped = alternating_speeds(lms, [1], decode_tokens=4, min_rounds=2, max_rounds=6, settled=lambda s: False,
                                seconds=1e-9)
    assert len(capped["a"]["decode"]) == 2
    ample = alternating_speeds(lms, [1], decode_tokens=4, min_rounds=2, max_rounds=6, seconds=1e9)
    assert len(ample["a"]["decode"]) == 6


def test_evaluate_times_identical_variants_once_and_passes_on_the_measuring_process_progress(trained, exported,
                                                                                           tmp_path):
    twin = tmp_path / "pruned"  # the same computation as the recovered model: same format, shapes and size
    shutil.copytree(trained.path("model"), twin)
    lines: list[str] = []
    with MeasuringProcess() as measurer:
        # a variant that cannot be measured fails alone, with its own error, and the next one is measured
        with pytest.raises(RuntimeError, match=r"measuring variant broken failed \(exit 1\):(.|\n)*no-such-model"):
            measurer.measure("broken", lines.append, model_path=str(tmp_path / "no-such-model"),
                             tokenize_dir=str(tmp_path), max_tokens=64, batch_sizes=[1], prompts=[],
                             max_new_tokens=1, threads=1, seed=0)
        speeds = measurer.measure(
            "speeds", lines.append, speeds=True, model_paths={"pruned": str(twin), "recovered": str(trained.path("model")),
                                                              "onnx-fp32": str(exported[0].path("onnx"))},
            batch_sizes=[1], decode_tokens=4, threads=1, rounds=5, min_rounds=2, seconds=1e-6)
    assert speeds["pruned"]["timed_as"] == "recovered"
    # a run stopped mid-measurement (here: its progress callback raises) leaves no measuring process behind
    left: list[psutil.Process] = []

    def stopped(line: str) -> None:
        left.extend(psutil.Process(measurer.pid).children())  # the forked child at work
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), MeasuringProcess() as measurer:
        left.append(psutil.Process(measurer.pid))
        measurer.measure("speeds", stopped, speeds=True, model_paths={"onnx-fp32": str(exported[0].path("onnx"))},
                         batch_sizes=[1], decode_tokens=4, threads=1, rounds=1000, min_rounds=1000, seconds=None)
    assert len(left) == 2
    for process in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            assert process.wait(timeout=5) is not None or process.status() == psutil.STATUS_ZOMBIE
    assert speeds["pruned"]["decode_tok_s"] == speeds["recovered"]["decode_tok_s"] > 0
    assert "timed_as" not in speeds["recovered"] and "timed_as" not in speeds["onnx-fp32"]
    assert all(v["speed_rounds"] == 2 for v in speeds.values())  # the cap stopped it at the minimum
    assert [line.split(" (")[0] for line in lines] == ["timing round 1", "timing round 2"]
    assert "of 2 models" in lines[0]


def test_champion_gate_promotes_only_a_better_model():
    better, worse = Score(1.9, 5.0, 1.5, 100, 300), Score(2.1, 6.0, 1.6, 100, 300)
    assert decide(better, None, None, None)[0] is True  # no champion yet
    promote, why = decide(better, worse, "3", None)
    assert promote is True and "1.9000" in why and "2.1000" in why
    promote, why = decide(worse, better, "3", None)
    assert promote is False and "version 3" in why
    promote, why = decide(better, None, "3", "cannot be read")
    assert promote is False and "cannot be read" in why



def test_the_gate_counts_agreement_where_fp32_is_confident():
    """Near-ties flip with any rounding: a candidate that disagrees only where fp32's top choice is unsure
    agrees fully for the gate; one that flips a confident choice does not; no confident token leaves bpb to decide."""
    fp32_greedy = np.array([5, 5, 7, 9, 1, 2])
    fp32_top = np.array([0.9, 0.8, 0.2, 0.3, 0.6, 0.1])  # confident at positions 0, 1 and 4
    ties_only = np.array([5, 5, 3, 4, 1, 8])
    assert (ties_only == fp32_greedy).mean() == 0.5 and confident_agreement(ties_only, fp32_greedy, fp32_top) == 1.0
    flips_one = np.array([5, 6, 7, 9, 1, 2])
    assert confident_agreement(flips_one, fp32_greedy, fp32_top) == pytest.approx(2 / 3, abs=1e-5)
    assert confident_agreement(flips_one, fp32_greedy, np.full(6, 0.1)) == 1.0


def test_scoring_gives_the_probability_of_each_greedy_choice(trained, tokenized):
    lm = load_language_model(trained.path("model"))
    tokens = open_shards(Path(tokenized.output_dir), lm.cfg.block_size).val[: 2 * lm.cfg.block_size + 1]
    scored = score_with_choices(lm, tokens, token_byte_lengths(lm.tokenizer))
    probs = torch.softmax(torch.from_numpy(lm.decoder.logits(np.asarray(tokens[:lm.cfg.block_size])[None])[0]), -1)
    assert np.array_equal(scored.choices.greedy[:lm.cfg.block_size], probs.argmax(-1).numpy())
    assert np.allclose(scored.choices.top_p[:lm.cfg.block_size], probs.max(-1).values.numpy(), atol=1e-5)
    assert scored.kl is None and scored.score == score_tokens(lm, tokens, token_byte_lengths(lm.tokenizer))


def test_kl_to_a_reference_is_zero_for_itself_and_bounds_the_full_kl_from_below(trained, tokenized):
    """KL over the reference's top tokens plus one 'rest' outcome: zero for the same model, and for a model
    whose logits are perturbed, positive and at most the exact KL over the whole vocabulary."""
    lm = load_language_model(trained.path("model"))
    tokens = np.asarray(open_shards(Path(tokenized.output_dir), lm.cfg.block_size).val[: lm.cfg.block_size + 1])
    lengths = token_byte_lengths(lm.tokenizer)
    reference = score_with_choices(lm, tokens, lengths).choices
    assert score_with_choices(lm, tokens, lengths, reference=reference).kl == pytest.approx(0.0, abs=1e-6)
    exact_logits = lm.decoder.logits(tokens[:-1][None])[0]
    noise = np.random.default_rng(0).normal(0, 0.5, exact_logits.shape).astype(np.float32)
    noisy = copy.copy(lm)
    noisy.decoder = SimpleNamespace(cfg=lm.cfg, logits=lambda x: lm.decoder.logits(x) + noise[None, :x.shape[1]])
    kl = score_with_choices(noisy, tokens, lengths, reference=reference).kl
    p = torch.log_softmax(torch.from_numpy(exact_logits), -1)
    q = torch.log_softmax(torch.from_numpy(exact_logits + noise), -1)
    exact = float((p.exp() * (p - q)).sum(-1).mean())
    assert 0 < kl <= exact + 1e-6 and kl > 0.5 * exact
