import json
import logging

import pytest
import torch

from cpuforge.models.checkpoint import (
    CheckpointError,
    latest_valid_checkpoint,
    load_model,
    save_model,
    save_training_checkpoint,
)
from cpuforge.models.config import LlamaConfig, ModelConfigError
from cpuforge.models.llama import Llama, flops_per_token, param_count, rope_cache, zero_residual_projections
from cpuforge.models.runtime import generate

CFG = LlamaConfig(vocab_size=97, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_mlp=64, block_size=32)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return Llama(CFG).eval()


def test_future_tokens_do_not_change_past_logits(model):
    x = torch.randint(0, 97, (2, 20))
    y = x.clone()
    y[:, 12:] = torch.randint(0, 97, (2, 8))
    assert torch.allclose(model(x)[0][:, :12], model(y)[0][:, :12], atol=1e-6)
    assert not torch.allclose(model(x)[0][:, 12:], model(y)[0][:, 12:])


def test_kv_cache_gives_the_same_logits_as_a_full_forward(model):
    x = torch.randint(0, 97, (3, 24))
    full, _ = model(x)
    first, cache = model(x[:, :10])
    rest, cache = model(x[:, 10:23], cache=cache, start=10)
    last, _ = model(x[:, 23:], cache=cache, start=23)
    assert torch.allclose(torch.cat([first, rest, last], 1), full, atol=1e-5)


def test_greedy_generation_matches_stepwise_argmax_and_stops(model):
    prompt = [5, 6, 7]
    out = list(generate(model, prompt, 8))
    seq = list(prompt)
    for _ in range(8):
        seq.append(int(model(torch.tensor([seq]))[0][0, -1].argmax()))
    assert out == seq[3:]
    assert list(generate(model, prompt, 8, stop_token=out[0])) == []
    assert list(generate(model, prompt, 8, temperature=1.0, top_k=1)) == out  # top-1 sampling is greedy
    assert len(list(generate(model, list(range(30)), 100))) <= 2  # never past the context
    with pytest.raises(ValueError, match="at most 31"):
        list(generate(model, list(range(32)), 4))


def test_shapes_counts_and_flops():
    tied, untied = Llama(CFG), Llama(LlamaConfig(**{**CFG.to_dict(), "tie_embeddings": False}))
    assert param_count(untied) - param_count(tied) == 97 * 32
    assert Llama(LlamaConfig(**{**CFG.to_dict(), "n_kv_head": 4}))(torch.zeros(1, 4, dtype=torch.long))[0].shape == (1, 4, 97)
    # 6N rule of thumb: every matmul parameter (LM head included) costs 6 FLOPs per token, plus attention.
    matmul = param_count(untied) - 97 * 32 - sum(p.numel() for n, p in untied.named_parameters() if "norm" in n)
    assert flops_per_token(CFG, 32) == 6 * matmul + 12 * 2 * 32 * 32


@pytest.mark.parametrize("bad, message", [
    (dict(n_head=5), "n_head=5 does not divide d_model=32"),
    (dict(n_kv_head=3), "n_kv_head=3 does not divide n_head=4"),
    (dict(d_model=36, n_head=12, n_kv_head=4), "head_dim=3 must be even"),
    (dict(vocab_size=0), "vocab_size=0 must be positive"),
])
def test_impossible_configs_are_rejected(bad, message):
    with pytest.raises(ModelConfigError, match=message):
        LlamaConfig(**{**CFG.to_dict(), **bad})


def test_checkpoint_round_trip_and_verification(tmp_path, model):
    save_model(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m", expect=CFG).eval()
    x = torch.randint(0, 97, (1, 16))
    assert torch.equal(loaded(x)[0], model(x)[0])
    assert loaded.lm_head.weight is loaded.tok_emb.weight  # still tied

    with pytest.raises(CheckpointError, match="made for another model: d_mlp=64 \\(expected 128\\)"):
        load_model(tmp_path / "m", expect=LlamaConfig(**{**CFG.to_dict(), "d_mlp": 128}))
    weights = tmp_path / "m" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        load_model(tmp_path / "m")
    weights.write_bytes(data)
    cfg_json = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg_json["intermediate_size"] = 48  # transformers' name for d_mlp
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg_json))
    with pytest.raises(CheckpointError, match="does not match its config: shape mismatch"):
        load_model(tmp_path / "m")
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_model(tmp_path / "nothing")


def test_a_corrupted_newest_checkpoint_falls_back_to_the_previous(tmp_path, model, caplog):
    opt = torch.optim.AdamW(model.parameters())
    for step in (10, 20):
        save_training_checkpoint(tmp_path, step, model, opt.state_dict(), {"step": step})
    newest = tmp_path / "step-00000020" / "optimizer.pt"
    newest.write_bytes(newest.read_bytes()[:-10])
    with caplog.at_level(logging.WARNING, logger="cpuforge"):
        assert latest_valid_checkpoint(tmp_path).name == "step-00000010"
    assert "step-00000020: optimizer.pt is truncated or corrupted" in caplog.text
    (tmp_path / "step-00000010" / "manifest.json").unlink()
    assert latest_valid_checkpoint(tmp_path) is None
    save_training_checkpoint(tmp_path, 30, model, opt.state_dict(), {"step": 30}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000020", "step-00000030"]


def test_activation_checkpointing_recomputes_blocks_and_keeps_gradients():
    torch.manual_seed(0)
    plain, ckpt = Llama(CFG), Llama(CFG)
    ckpt.load_state_dict(plain.state_dict())
    ckpt.activation_checkpointing = True
    calls = {"plain": 0, "ckpt": 0}
    plain.blocks[0].attn.register_forward_hook(lambda *a: calls.__setitem__("plain", calls["plain"] + 1))
    ckpt.blocks[0].attn.register_forward_hook(lambda *a: calls.__setitem__("ckpt", calls["ckpt"] + 1))
    x = torch.randint(0, 97, (2, 16))
    for m in (plain, ckpt):
        m.loss(x[:, :-1], x[:, 1:]).backward()
    assert calls == {"plain": 1, "ckpt": 2}  # the backward pass re-ran the block
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_zero_initialised_output_projections_make_every_block_the_identity():
    torch.manual_seed(0)
    m = Llama(CFG).eval()
    zero_residual_projections(m)
    idx = torch.randint(0, CFG.vocab_size, (2, 16))
    with torch.no_grad():
        logits, _ = m(idx)
        assert torch.equal(logits, m.lm_head(m.norm(m.tok_emb(idx))))
    m.train()
    m(idx)[0].sum().backward()
    assert m.blocks[0].attn.wo.weight.grad.abs().sum() > 0  # they still learn
    assert m.blocks[0].mlp.down.weight.grad.abs().sum() > 0


def test_fused_attention_path_computes_what_the_separate_projections_do():
    """A cacheless pass computes q/k/v as one matmul and rotates q and k together; the result and
    every weight's gradient must equal the separate path (the masked one, as the ONNX decoder runs it)."""
    torch.manual_seed(0)
    fused, separate = Llama(CFG).blocks[0], Llama(CFG).blocks[0]
    separate.load_state_dict(fused.state_dict())
    T = 16
    cos, sin = rope_cache(CFG, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    x = torch.randn(2, T, CFG.d_model)
    out_fused, (k_fused, v_fused) = fused(x, cos, sin)
    out_separate, (k_sep, v_sep) = separate(x, cos, sin, None, causal)
    assert torch.allclose(out_fused, out_separate, atol=1e-5)
    assert torch.allclose(k_fused, k_sep, atol=1e-6) and torch.allclose(v_fused, v_sep, atol=1e-6)
    grad = torch.randn_like(out_fused)
    out_fused.backward(grad)
    out_separate.backward(grad)
    assert list(dict(fused.named_parameters())) == list(dict(separate.named_parameters()))  # names unchanged
    for (name, a), b in zip(fused.named_parameters(), separate.parameters()):
        assert a.grad is not None and torch.allclose(a.grad, b.grad, atol=1e-5), name


def test_the_training_loss_is_the_cross_entropy_of_the_logits_and_trains_the_same(model):
    """forward(targets=...) takes the LM head and cross-entropy in slices of the tokens:
    the same loss, and the same gradients, as the cross-entropy over the whole batch's logits."""
    x, y = torch.randint(0, 97, (3, 31)), torch.randint(0, 97, (3, 31))  # 93 tokens: unequal slices
    sliced = model(x, targets=y)[0]
    sliced.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits, _ = model(x)
    full = torch.nn.functional.cross_entropy(logits.view(-1, 97), y.view(-1))
    full.backward()
    assert sliced.dtype == torch.float32 and torch.allclose(sliced, full, atol=1e-6)
    assert all(torch.allclose(grads[n], p.grad, atol=1e-6) for n, p in model.named_parameters())
    assert torch.equal(model.loss(x, y), sliced)
