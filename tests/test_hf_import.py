"""Compressing a transformers Llama checkpoint made elsewhere: `cpuforge compress --pretrained hf:DIR`
through the CLI's entry point, as a user runs it, on a model this test builds, trains a few steps and saves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cpuforge.flows.cli import main
from cpuforge.tasks import stages as registry
from tests.conftest import make_text
from tests.test_hf_format import assert_transformers_matches

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SPECIAL = ["<unk>", "<s>", "</s>"]  # the model's eos, "</s>", is not cpuforge's default end-of-document token


def make_corpus(root: Path) -> Path:
    root.mkdir(parents=True)
    for i in range(40):
        (root / f"{i}.txt").write_text(make_text(i, 80))
    return root


def save_hf_llama(folder: Path, corpus: Path, steps: int = 30, **config: object) -> Path:
    """A small LlamaForCausalLM with a BPE tokenizer of its own, trained a few steps, save_pretrained'ed."""
    texts = [p.read_text() for p in sorted(corpus.glob("*.txt"))]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>",
                                                     eos_token="</s>")
    cfg = transformers.LlamaConfig(
        vocab_size=bpe.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        bos_token_id=bpe.token_to_id("<s>"), eos_token_id=bpe.token_to_id("</s>"), **config)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.tensor([t for text in texts for t in bpe.encode(text).ids + [cfg.eos_token_id]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        starts = torch.randint(0, len(ids) - 65, (8,), generator=torch.Generator().manual_seed(step))
        batch = torch.stack([ids[s:s + 64] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_compress_a_transformers_llama_end_to_end(tmp_path, prefect_server, capsys):
    corpus = make_corpus(tmp_path / "corpus")
    source = save_hf_llama(tmp_path / "hf-llama", corpus)
    workdir = tmp_path / "work"
    code = main(["compress", "--pretrained", f"hf:{source}", "--profile", "tiny", "--workdir", str(workdir),
                 "--summary", str(workdir / "summary.json"), "--set", f"data.source={corpus}"])
    assert code == 0, capsys.readouterr().err[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    stages = summary["stages"]
    assert summary["flow"] == "compress" and summary["status"] == "completed"
    assert list(stages) == registry.names(registry.COMPRESS)
    assert {s["status"] for s in stages.values()} == {"completed"}
    assert summary["registry"]["version"] == "1" and summary["registry"]["decision"] == "promoted"
    assert summary["pretrained_from"]["origin"] == f"hf:{source}"
    # The checkpoint's own tokenizer and eos token are what the data is tokenized with.
    meta = json.loads((Path(stages["tokenize"]["output_dir"]) / "meta.json").read_text())
    assert meta["eod_token"] == "</s>" and meta["vocab_size"] == json.loads((source / "config.json").read_text())["vocab_size"]

    adopted = Path(stages["adopt"]["output_dir"]) / "model"
    assert json.loads((adopted / "config.json").read_text())["max_position_embeddings"] == 64  # the profile's context
    hf = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    x = torch.randint(0, hf.config.vocab_size, (1, 32))
    from cpuforge.models.checkpoint import load_model

    with torch.no_grad():  # adopted as it was: the same function
        assert (load_model(adopted).eval()(x)[0] - hf(x).logits).abs().max() < 1e-4
    # What cpuforge wrote loads back into transformers, pruned (heads keep their width) and recovered.
    pruned, recovered = (Path(stages[n]["output_dir"]) / "model" for n in ("prune", "recover"))
    shape = json.loads((pruned / "config.json").read_text())
    assert shape["hidden_size"] < 64 and shape["head_dim"] == 16 and shape["tie_word_embeddings"] is False
    for folder in (pruned, recovered):
        assert_transformers_matches(folder)
        card = (folder / "README.md").read_text()
        assert "bits per byte" in card and f"`{corpus}`" in card and "**prune**" in card


def test_continue_pretraining_a_transformers_llama(tmp_path, prefect_server, capsys):
    """`cpuforge run --set train.init_from=hf:DIR`: the checkpoint's shape and tokenizer, its context cut to the
    profile's, trained on from its weights; `--stop-after pretrain` stops there and registers nothing."""
    corpus = make_corpus(tmp_path / "corpus")
    source = save_hf_llama(tmp_path / "hf-llama", corpus)
    workdir = tmp_path / "work"
    code = main(["run", "--profile", "tiny", "--workdir", str(workdir), "--summary", str(workdir / "summary.json"),
                 "--set", f"data.source={corpus}", "--set", f"train.init_from=hf:{source}",
                 "--set", "train.max_steps=5", "--stop-after", "pretrain"])
    assert code == 0, capsys.readouterr().err[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert list(summary["stages"]) == ["tokenize", "pretrain"] and summary["stopped_after"] == "pretrain"
    assert summary["pretrained_from"]["origin"] == f"hf:{source}" and "registry" not in summary
    meta = json.loads((Path(summary["stages"]["tokenize"]["output_dir"]) / "meta.json").read_text())
    assert meta["eod_token"] == "</s>"  # the checkpoint's tokenizer and eos
    theirs = json.loads((source / "config.json").read_text())
    trained = json.loads((Path(summary["stages"]["pretrain"]["output_dir"]) / "model" / "config.json").read_text())
    for field in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size", "tie_word_embeddings"):
        assert trained[field] == theirs[field], field
    assert trained["max_position_embeddings"] == 64  # the tiny profile's context
    assert summary["stages"]["pretrain"]["metrics"]["steps"] == 5


def test_an_unsupported_checkpoint_fails_with_one_line(tmp_path, capsys):
    corpus = make_corpus(tmp_path / "corpus")
    source = save_hf_llama(tmp_path / "biased", corpus, steps=0, attention_bias=True)

    def error_line() -> str:
        code = main(["compress", "--pretrained", f"hf:{source}", "--profile", "tiny", "--workdir", str(tmp_path / "w"),
                     "--set", f"data.source={corpus}"])
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and "Traceback" not in err and len(errors) == 1, err
        return errors[0]

    assert "unsupported model: attention_bias=true" in error_line()
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "attention_bias": False, "sliding_window": 32}))
    assert "unsupported model: sliding_window=32" in error_line()
    (source / "config.json").write_text(json.dumps({**config, "attention_bias": False, "model_type": "mistral",
                                                    "architectures": ["MistralForCausalLM"]}))
    assert "model_type 'mistral'" in error_line()
    (source / "config.json").write_text(json.dumps({**config, "attention_bias": False}))
    (source / "tokenizer.json").unlink()
    assert "unsupported model: no tokenizer.json" in error_line()
