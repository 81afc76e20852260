"""Model folders in transformers' layout: transformers loads what cpuforge trains (same logits, same
tokens, same greedy text), and cpuforge still loads folders written the old way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from cpuforge.models.checkpoint import CheckpointError, load_model, read_config, save_model
from cpuforge.models.config import LlamaConfig
from cpuforge.models.llama import Llama
from cpuforge.models.runtime import generate, load_language_model
from cpuforge.tasks.engine.training_run import run_training
from tests.test_pretrain import shards, spec_for  # noqa: F401  (module fixture)

transformers = pytest.importorskip("transformers")

TEXT = "Return the value of the function from the module.\nThe model reads text and"


def assert_transformers_matches(folder: Path, text: str = TEXT, new_tokens: int = 12) -> float:
    """transformers loads `folder`; its tokens, logits and greedy continuation equal cpuforge's.
    Returns the largest logit difference."""
    folder = Path(folder)
    ours = load_model(folder).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids[: ours.cfg.block_size - new_tokens]
    assert hf_tok(text, add_special_tokens=True)["input_ids"][: len(ids)] == ids  # no BOS slipped in front
    assert hf_tok.decode(ids) == tok.decode(ids)

    eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    assert hf_tok.eos_token_id == eos and hf.generation_config.eos_token_id == eos
    x = torch.tensor([ids])
    with torch.no_grad():
        diff = (ours(x)[0] - hf(x).logits).abs().max().item()
        hf_out = hf.generate(x, max_new_tokens=new_tokens, do_sample=False, attention_mask=torch.ones_like(x))
    assert diff < 1e-4
    ours_out = list(generate(ours, ids, new_tokens, stop_token=eos))
    hf_new = hf_out[0, len(ids):].tolist()
    assert hf_new[: len(ours_out)] == ours_out and hf_new[len(ours_out):] in ([], [eos])
    return diff


@pytest.fixture(scope="module")
def trained(shards, tmp_path_factory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("trained")
    run_training(spec_for(shards, out, "train.max_steps=40", "model.tie_embeddings=false"))
    return out / "model"


def test_training_writes_a_folder_transformers_loads(trained):
    names = {p.name for p in trained.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json"} <= names
    config = json.loads((trained / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is False and config["head_dim"] == 16
    tokens = json.loads((trained / "special_tokens_map.json").read_text())
    assert tokens["eos_token"] == tokens["bos_token"] == "<|endoftext|>"
    from safetensors import safe_open

    with safe_open(str(trained / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"} and "model.layers.0.self_attn.q_proj.weight" in f.keys()
    diff = assert_transformers_matches(trained)
    print(f"max |logit diff| transformers vs cpuforge: {diff:.2e}")


def test_pruned_shape_round_trips(tmp_path):
    """head_dim != d_model / n_head (embedding channels pruned, heads kept) and untied embeddings."""
    cfg = LlamaConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=40, d_mlp=48, block_size=32,
                      tie_embeddings=False, head_dim_override=16)
    model = Llama(cfg)
    save_model(model, tmp_path)
    assert read_config(tmp_path) == cfg
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.head_dim == 16 and hf.config.hidden_size == 40
    x = torch.randint(0, 64, (2, 20))
    with torch.no_grad():
        assert (model.eval()(x)[0] - hf(x).logits).abs().max() < 1e-4


def test_a_folder_written_by_an_earlier_version_still_loads(tmp_path, trained):
    """The old layout: config.json {"format": 1, "model": {...}} and cpuforge's own tensor names."""
    model = load_model(trained)
    old = tmp_path / "old"
    old.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(old / "model.safetensors"), metadata={"format": "1"})
    (old / "config.json").write_text(json.dumps({"format": 1, "model": model.cfg.to_dict(), "dtype": "float32"}))
    (old / "tokenizer.json").write_text((trained / "tokenizer.json").read_text())
    assert "tok_emb.weight" in load_file(str(old / "model.safetensors"))
    x = torch.randint(0, model.cfg.vocab_size, (1, 16))
    with torch.no_grad():
        assert torch.equal(load_model(old).eval()(x)[0], model.eval()(x)[0])
    lm = load_language_model(old)
    assert lm.eod_id == Tokenizer.from_file(str(old / "tokenizer.json")).token_to_id("<|endoftext|>")
    assert isinstance("".join(lm.stream("The model", 5, temperature=0)), str)


def test_unsupported_transformers_config_is_named(tmp_path, trained):
    folder = tmp_path / "biased"
    folder.mkdir()
    config = json.loads((trained / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(CheckpointError, match="attention_bias=true"):
        read_config(folder)
