"""The fused distillation loss (models/distill_head.py) is the written-out one: same loss, same gradients."""

import pytest
import torch

from cpuforge.models import distill_head
from cpuforge.models.config import LlamaConfig
from cpuforge.models.llama import Llama
from cpuforge.tasks.engine.losses import distillation_loss, reference_distillation_loss


def _models(vocab: int = 300):
    torch.manual_seed(0)
    teacher = Llama(LlamaConfig(vocab_size=vocab, d_model=48, n_layer=2, n_head=4, n_kv_head=2, d_mlp=96,
                                block_size=32))
    student = Llama(LlamaConfig(vocab_size=vocab, d_model=32, n_layer=1, n_head=2, n_kv_head=1, d_mlp=64,
                                block_size=32, tie_embeddings=False))
    x = torch.randint(0, vocab, (3, 32))
    return teacher, student, x, torch.roll(x, -1, dims=1)


def _loss_and_grads(loss_fn, student, x, y):
    student.zero_grad(set_to_none=True)
    total, parts = loss_fn(student, x, y)
    total.backward()
    return total.item(), parts, {name: p.grad.clone() for name, p in student.named_parameters()}


@pytest.mark.parametrize("temperature,kd_weight,lm_weight", [(1.0, 1.0, 0.5), (2.0, 0.7, 0.3), (1.0, 1.0, 0.0),
                                                             (3.0, 0.0, 1.0)])
def test_fused_loss_matches_the_written_out_one(monkeypatch, temperature, kd_weight, lm_weight):
    teacher, student, x, y = _models()
    monkeypatch.setattr(distill_head, "SLICE_ELEMENTS", 300 * 40)  # several slices, the last one short
    fused = _loss_and_grads(distillation_loss(teacher, temperature, kd_weight, lm_weight), student, x, y)
    written = _loss_and_grads(reference_distillation_loss(teacher, temperature, kd_weight, lm_weight), student, x, y)
    assert fused[0] == pytest.approx(written[0], rel=1e-5)
    for name in ("kd_loss", "lm_loss"):
        assert fused[1][name] == pytest.approx(written[1][name], rel=1e-5, abs=1e-6)
    for name, grad in written[2].items():
        torch.testing.assert_close(fused[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_fused_loss_under_bf16_autocast_stays_close():
    teacher, student, x, y = _models()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = _loss_and_grads(distillation_loss(teacher, 1.0, 1.0, 0.5), student, x, y)
        written = _loss_and_grads(reference_distillation_loss(teacher, 1.0, 1.0, 0.5), student, x, y)
    assert fused[0] == pytest.approx(written[0], rel=2e-2)
    head = "lm_head.weight"
    cos = torch.nn.functional.cosine_similarity(fused[2][head].flatten(), written[2][head].flatten(), dim=0)
    assert cos > 0.99
    assert all(grad.dtype == torch.float32 for grad in fused[2].values())


def test_distill_needs_targets():
    teacher, student, x, _ = _models()
    with pytest.raises(ValueError, match="targets"):
        student(x, distill=distill_head.Distillation(teacher(x, hidden=True)[0], teacher.lm_head.weight))


def test_a_compiled_student_computes_the_same_loss_with_the_head_loss_left_eager(monkeypatch):
    import functools

    teacher, student, x, y = _models()
    monkeypatch.setattr(distill_head, "SLICE_ELEMENTS", 300 * 40)  # several slices: traced, the loop would unroll
    eager = _loss_and_grads(distillation_loss(teacher, 2.0, 0.5, 0.5), student, x, y)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))  # dynamo, no C++ build
    # the module as a fresh process has it (an earlier test may have compiled a model already)
    monkeypatch.setattr(distill_head, "distillation_head_loss", getattr(
        distill_head.distillation_head_loss, "_torchdynamo_orig_callable", distill_head.distillation_head_loss))
    assert not getattr(distill_head.distillation_head_loss, "_torchdynamo_disable", False)
    student.compile_forward()
    assert distill_head.distillation_head_loss._torchdynamo_disable  # what compile leaves to eager
    compiled = _loss_and_grads(distillation_loss(teacher, 2.0, 0.5, 0.5), student, x, y)
    assert compiled[0] == pytest.approx(eager[0], rel=1e-5)
    for name, grad in eager[2].items():
        torch.testing.assert_close(compiled[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_importing_the_model_does_not_load_the_compiler():
    """Evaluate measures each variant in a fresh interpreter: torch._dynamo's import would cost each 2.5 s."""
    import subprocess
    import sys

    code = "import sys, cpuforge.tasks.engine.measure; print('torch._dynamo' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == \
        "False"
