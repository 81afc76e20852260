"""GGUF for llama.cpp: the gguf stage's files as a GGUF reader sees them, and (with llama-cpp-python
installed) llama.cpp itself tokenizing and generating exactly as cpuforge does.

The model is of a pruned shape (head_dim 32 while d_model / n_head is 16; an MLP width of 3 x 32, as
prune.width_multiple's default leaves it), trained for a few seconds on the tokenize stage's output.
"""

from __future__ import annotations

import itertools
import shutil
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from cpuforge.models.checkpoint import load_model, save_model
from cpuforge.models.config import LlamaConfig
from cpuforge.models.gguf_export import GGUFExportError, write_gguf
from cpuforge.models.llama import Llama
from cpuforge.models.llama_cpp_runtime import LlamaCppModel
from cpuforge.models.runtime import generate, load_language_model
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.data import BatchSampler, open_shards, token_byte_lengths
from cpuforge.tasks.engine.hardware import int8_dot_product
from cpuforge.tasks.infra.store import StageRecord
from cpuforge.tasks.records.errors import UserError
from cpuforge.tasks.stages.gguf import export_gguf
from cpuforge.tasks.stages.tokenize import tokenize
from tests.conftest import make_text

BLOCK = 64
TEXTS = [
    "Hello world",
    "def main():\n    return 42\n",
    "digits 0 7 12 345 6789 3.14159 and 1,000,000",
    "  leading spaces, two  inside,\ttabs\tand trailing   ",
    "lines\n\nblank\r\nwindows\n\n\n",
    "Grüße, naïve café — 日本語のテキスト 🙂",
    "it's they're we've I'll you'd",
    "the model says <|endoftext|> as text",
]


def train_briefly(model: Llama, shards, steps: int = 60) -> None:
    """Enough training that greedy choices are not near-ties between random logits."""
    torch.manual_seed(0)
    sampler = BatchSampler(shards.train, 8, BLOCK, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for step in range(steps):
        x, y = sampler.batch(step)
        optimizer.zero_grad()
        model.loss(x, y).backward()
        optimizer.step()
    model.eval()


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def stage_inputs(request, tmp_path_factory) -> tuple[StageRecord, StageRecord]:
    """(tokenize's record, recover's record) as the gguf stage receives them."""
    root = tmp_path_factory.mktemp("gguf")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(30):
        (corpus / f"doc{i}.txt").write_text(make_text(i), encoding="utf-8")
    (corpus / "unicode.txt").write_text("Grüße, naïve café — 日本語のテキスト 🙂\n" * 20, encoding="utf-8")
    tokenized = root / "tokenize"
    tokenized.mkdir()
    cfg = load_config("tiny", overrides=[f"data.source={corpus}", "data.max_docs=null"])
    tokenize(cfg.data, cfg.tokenizer, tokenized, root / "cache")
    shards = open_shards(tokenized, BLOCK)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=shards.vocab_size, n_layer=2, n_head=4, n_kv_head=2, d_model=64,
                              head_dim_override=32, d_mlp=96, block_size=BLOCK, tie_embeddings=request.param))
    train_briefly(model, shards)
    model_dir = root / "recover" / "model"
    save_model(model, model_dir)
    shutil.copy(tokenized / "tokenizer.json", model_dir / "tokenizer.json")
    return (StageRecord(stage="tokenize", key="tokenize-test", output_dir=str(tokenized)),
            StageRecord(stage="recover", key="recover-test", output_dir=str(root / "recover"),
                        files={"model": "model"}))


@pytest.fixture(scope="module")
def gguf_files(stage_inputs, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf-out")
    output = export_gguf(*stage_inputs, out)
    return {role: out / name for role, name in output.files.items()}


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def test_the_files_hold_the_model_under_llama_cpp_names_and_metadata(stage_inputs, gguf_files):
    tokenized, recovered = stage_inputs
    cfg = load_model(recovered.path("model")).cfg
    tokenizer = Tokenizer.from_file(str(recovered.path("model") / "tokenizer.json"))
    eod = open_shards(Path(tokenized.output_dir), BLOCK).eod_id
    expected_shapes = {"token_embd.weight": [cfg.d_model, cfg.vocab_size], "output_norm.weight": [cfg.d_model]}
    if not cfg.tie_embeddings:  # llama.cpp falls back to token_embd when output is absent
        expected_shapes["output.weight"] = [cfg.d_model, cfg.vocab_size]
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    for i in range(cfg.n_layer):  # ggml lists dimensions innermost first
        expected_shapes.update({
            f"blk.{i}.attn_norm.weight": [cfg.d_model], f"blk.{i}.ffn_norm.weight": [cfg.d_model],
            f"blk.{i}.attn_q.weight": [cfg.d_model, q], f"blk.{i}.attn_k.weight": [cfg.d_model, kv],
            f"blk.{i}.attn_v.weight": [cfg.d_model, kv], f"blk.{i}.attn_output.weight": [q, cfg.d_model],
            f"blk.{i}.ffn_gate.weight": [cfg.d_model, cfg.d_mlp], f"blk.{i}.ffn_up.weight": [cfg.d_model, cfg.d_mlp],
            f"blk.{i}.ffn_down.weight": [cfg.d_mlp, cfg.d_model]})
    vocab = {i: t for t, i in tokenizer.get_vocab().items()}
    for role, path in gguf_files.items():
        reader = gguf.GGUFReader(path)
        assert {t.name: t.shape.tolist() for t in reader.tensors} == expected_shapes
        assert field(reader, "general.architecture") == "llama"
        assert {k: field(reader, f"llama.{k}") for k in (
            "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
            "attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.dimension_count",
            "vocab_size")} == {
            "context_length": BLOCK, "embedding_length": 64, "block_count": 2, "feed_forward_length": 96,
            "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 32,
            "attention.value_length": 32, "rope.dimension_count": 32, "vocab_size": cfg.vocab_size}
        assert field(reader, "llama.rope.freq_base") == cfg.rope_theta
        assert field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(cfg.norm_eps)
        assert field(reader, "tokenizer.ggml.model") == "gpt2" and field(reader, "tokenizer.ggml.pre") == "gpt-2"
        assert field(reader, "tokenizer.ggml.tokens") == [vocab[i] for i in range(cfg.vocab_size)]
        types = field(reader, "tokenizer.ggml.token_type")
        assert types[eod] == gguf.TokenType.CONTROL and types.count(gguf.TokenType.NORMAL) == cfg.vocab_size - 1
        assert len(field(reader, "tokenizer.ggml.merges")) > 0
        assert field(reader, "tokenizer.ggml.bos_token_id") == field(reader, "tokenizer.ggml.eos_token_id") == eod
        assert field(reader, "tokenizer.ggml.add_bos_token") is False
        by_type = {t.name: t.tensor_type.name for t in reader.tensors}
        norms = {name for name in by_type if name.endswith("norm.weight")}
        assert {by_type[name] for name in norms} == {"F32"}
        matrices = {name: kind for name, kind in by_type.items() if name not in norms}
        if role == "gguf_f32":
            assert set(matrices.values()) == {"F32"}
        elif role == "gguf_q8_0":  # every matrix, no f16 left behind
            assert set(matrices.values()) == {"Q8_0"}
        else:  # 4-bit, but the matrix that makes the logits (the tied embedding, or output) stays 8-bit
            logits_matrix = "token_embd.weight" if cfg.tie_embeddings else "output.weight"
            assert matrices.pop(logits_matrix) == "Q8_0" and set(matrices.values()) == {"Q4_0"}
    sizes = {role: path.stat().st_size for role, path in gguf_files.items()}
    assert sizes["gguf_q4_0"] < sizes["gguf_q8_0"] < sizes["gguf_f32"] / 2.5


def test_a_width_that_does_not_fit_the_blocks_is_an_error_with_the_fix(stage_inputs, tmp_path):
    tokenized, recovered = stage_inputs
    model = load_model(recovered.path("model"))
    odd = Llama(replace(model.cfg, d_mlp=80))  # what prune.width_multiple=8 could leave
    folder = tmp_path / "recover"
    save_model(odd, folder / "model")
    shutil.copy(recovered.path("model") / "tokenizer.json", folder / "model" / "tokenizer.json")
    out = tmp_path / "out"
    out.mkdir()
    record = StageRecord(stage="recover", key="recover-odd", output_dir=str(folder), files={"model": "model"})
    with pytest.raises(UserError, match=r"cannot write model-q8_0.gguf: q8_0 stores each row in blocks of 32 values, "
                                        r"and 2 matrices .*blk.0.ffn_down.weight \(rows of 80\).*prune.width_multiple=32"):
        export_gguf(tokenized, record, out)
    assert sorted(p.name for p in out.iterdir()) == ["model-f32.gguf"]  # f32 holds any width; nothing half-written


def test_the_q4_0_file_reads_back_within_its_step(stage_inputs, gguf_files):
    model = load_model(stage_inputs[1].path("model"))
    reader = gguf.GGUFReader(gguf_files["gguf_q4_0"])
    weight = model.state_dict()["blocks.0.mlp.up.weight"].numpy()
    got = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    back = gguf.quants.dequantize(got.data, got.tensor_type).reshape(weight.shape)
    blocks = weight.reshape(-1, 32)
    step = np.abs(blocks).max(axis=1, keepdims=True) / 8  # 16 levels over [-max, max]
    error = np.abs(back.reshape(-1, 32) - blocks)
    assert (error <= 1.01 * step + 1e-6).all() and error.mean() < 0.3 * step.mean()


def test_a_tokenizer_llama_cpp_would_split_differently_is_refused(tmp_path):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    model = Llama(LlamaConfig(vocab_size=8, n_layer=1, n_head=2, n_kv_head=1, d_model=16, d_mlp=32, block_size=16))
    with pytest.raises(GGUFExportError, match="pre-tokenizer"):
        write_gguf(model, tokenizer, 0, tmp_path / "model.gguf")
    assert not list(tmp_path.iterdir())


# --- llama.cpp itself -----------------------------------------------------------------------------

def llama_cpp_model(path: Path, logits_all: bool = False, f32_cache: bool = False):
    """llama.cpp with its defaults, or (f32_cache) keys and values cached in f32 rather than f16, so that
    its logits can be compared with cpuforge's to float32 precision.

    On a CPU with AMX-INT8 the weights stay in llama.cpp's plain CPU buffers (llama-cli's --no-repack): its
    AMX buffer type segfaults on any batch of more than one token of a Q8_0 model there (llama-cpp-python
    0.3.36; ggml-org/llama.cpp#20824), which would take the whole test session down with it."""
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama.cpp is not installed: `pip install llama-cpp-python` (builds from source, "
                            "~6 min; too long for CI) to check GGUF files against llama.cpp itself")
    cache = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if f32_cache else {}
    return LlamaCppModel(path, BLOCK, threads=2, logits_all=logits_all,
                         plain_buffers=int8_dot_product() == "amx_int8", **cache).llm


def llama_cpp_greedy(llm, prompt: list[int], n: int) -> list[int]:
    stream = llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)
    return list(itertools.islice(stream, n))


def prompts_of(tokenized: StageRecord, n: int = 4, length: int = 8) -> list[list[int]]:
    val = open_shards(Path(tokenized.output_dir), BLOCK).val
    starts = np.linspace(0, len(val) - length - 1, n).astype(int)
    return [[int(t) for t in val[s:s + length]] for s in starts]


def test_llama_cpp_tokenizes_as_cpuforge_does(stage_inputs, gguf_files):
    llm = llama_cpp_model(gguf_files["gguf_f32"])
    tokenizer = Tokenizer.from_file(str(stage_inputs[1].path("model") / "tokenizer.json"))
    tokenizer.encode_special_tokens = True  # as the tokenize stage encodes documents: the EOD spelling is text
    for text in TEXTS:
        ours = tokenizer.encode(text, add_special_tokens=False).ids
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ours, text
        assert llm.detokenize(ours).decode() == text


def test_llama_cpp_computes_what_cpuforge_computes(stage_inputs, gguf_files):
    tokenized, recovered = stage_inputs
    model = load_model(recovered.path("model"))
    llm = llama_cpp_model(gguf_files["gguf_f32"], logits_all=True, f32_cache=True)
    window = [t for p in prompts_of(tokenized, 4, 16) for t in p]
    llm.reset()
    llm.eval(window)
    with torch.no_grad():
        ours = model(torch.tensor([window]))[0][0].numpy()
    assert np.abs(np.asarray(llm.scores[:len(window)]) - ours).max() < 1e-3


def test_llama_cpp_greedy_generation_equals_cpuforge_token_for_token(stage_inputs, gguf_files):
    tokenized, recovered = stage_inputs
    model = load_model(recovered.path("model"))
    # keys and values cached in f32: llama.cpp's default f16 cache moves logits by ~1e-3, enough to flip a
    # near-tie within 40 tokens (seen on an AMX Xeon)
    llm = llama_cpp_model(gguf_files["gguf_f32"], f32_cache=True)
    n = 40
    for prompt in prompts_of(tokenized):
        assert llama_cpp_greedy(llm, prompt, n) == list(generate(model, prompt, n)), prompt


@pytest.mark.parametrize("role, agreement", [("gguf_q8_0", 0.8), ("gguf_q4_0", 0.6)])
def test_llama_cpp_runs_the_quantized_files(stage_inputs, gguf_files, role, agreement):
    tokenized, recovered = stage_inputs
    model = load_model(recovered.path("model"))
    llm = llama_cpp_model(gguf_files[role], logits_all=True)
    prompt = prompts_of(tokenized, 1, 32)[0]
    llm.reset()
    llm.eval(prompt)
    with torch.no_grad():
        ours = model(torch.tensor([prompt]))[0][0].numpy()
    theirs = np.asarray(llm.scores[:len(prompt)])
    # quantized weights move the logits (4-bit ones more), not the model's choices as a whole
    assert (theirs.argmax(-1) == ours.argmax(-1)).mean() >= agreement
    assert len(llama_cpp_greedy(llm, prompt[:8], 24)) == 24


def mean_nll(logits: np.ndarray, window: list[int]) -> float:
    """Mean next-token negative log-likelihood of `window` under `logits` (one row per position)."""
    scores = torch.log_softmax(torch.as_tensor(np.asarray(logits[:-1]), dtype=torch.float64), dim=-1)
    return float(-scores[torch.arange(len(window) - 1), torch.tensor(window[1:])].mean())


@pytest.mark.parametrize("role, tolerance", [("gguf_f32", 1e-5), ("gguf_q8_0", 0.01), ("gguf_q4_0", 0.03)])
def test_llama_cpp_scores_the_val_text_as_cpuforge_does(stage_inputs, gguf_files, role, tolerance):
    """Bits per byte is the mean negative log-likelihood over the bytes: llama.cpp's on the val text, from each
    file, within `tolerance` of cpuforge's own model's (f32 the same, Q8_0 within 1%, as llama-perplexity would say)."""
    tokenized, recovered = stage_inputs
    model = load_model(recovered.path("model"))
    llm = llama_cpp_model(gguf_files[role], logits_all=True, f32_cache=True)
    ours, theirs = [], []
    for window in prompts_of(tokenized, 4, BLOCK):
        llm.reset()
        llm.eval(window)
        theirs.append(mean_nll(llm.scores[:len(window)], window))
        with torch.no_grad():
            ours.append(mean_nll(model(torch.tensor([window]))[0][0].numpy(), window))
    assert abs(np.mean(theirs) / np.mean(ours) - 1) <= tolerance


def test_evaluate_measures_the_gguf_files_in_llama_cpp(stage_inputs, gguf_files):
    """What evaluate adds to its table where llama.cpp is installed: each file measured in a process of its own,
    scoring the val text as cpuforge's own model does it (within 1% for Q8_0), with speeds, size and samples."""
    pytest.importorskip("llama_cpp", reason="llama.cpp is not installed")
    from cpuforge.tasks.engine.measure import MeasuringProcess
    from cpuforge.tasks.engine.scoring import score_tokens
    from cpuforge.tasks.stages.evaluate import measure_ggufs

    tokenized, recovered = stage_inputs
    e = load_config("tiny", overrides=["eval.max_tokens=512", "eval.max_new_tokens=8", "eval.decode_tokens=8"]).eval
    with MeasuringProcess() as measurer:
        measured = measure_ggufs(e, tokenized, {"gguf-q8_0": gguf_files["gguf_q8_0"]}, ["def "], measurer)
    assert [m["variant"] for m in measured] == ["gguf-q8_0"]
    (q8,) = measured
    lm = load_language_model(recovered.path("model"))
    val = open_shards(Path(tokenized.output_dir), BLOCK).val[:e.max_tokens + 1]
    ours = score_tokens(lm, np.asarray(val), token_byte_lengths(lm.tokenizer))
    assert q8["val_tokens"] == ours.tokens and q8["val_bpb"] == pytest.approx(ours.val_bpb, rel=0.01)
    assert q8["format"] == "gguf" and q8["runtime"] == "llama.cpp" and q8["params"] == lm.params
    assert q8["prefill_tok_s"] > 0 and q8["decode_tok_s"] > 0 and q8["peak_rss_mb"] > 0
    assert q8["file_bytes"] == gguf_files["gguf_q8_0"].stat().st_size and q8["samples"]["def "].startswith("def ")
