"""The training losses, shared by the trainer and the step timers (step_timing.training_step_timer), so
that what is timed is what is trained. Torch and the models only."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpuforge.models.distill_head import Distillation


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, targets=y)[0]  # through forward (and so DDP/FSDP/compile): Llama's sliced cross-entropy


def distillation_loss(teacher: torch.nn.Module, temperature: float, kd_weight: float, lm_weight: float):
    """Knowledge distillation: kd_weight x T^2 x KL(teacher || student) on logits softened by temperature T,
    plus lm_weight x the next-token cross-entropy. The teacher gives its final hidden states; the student's
    forward computes both models' logits and the loss a slice of tokens at a time (models/distill_head.py),
    never the batch's full-vocabulary logits."""
    teacher.eval()

    def loss(student: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
        with torch.no_grad():
            teacher_hidden, _ = teacher(x, hidden=True)
        distill = Distillation(teacher_hidden, teacher.lm_head.weight.detach(), temperature, kd_weight, lm_weight)
        (total, kd, lm), _ = student(x, targets=y, distill=distill)
        return total, {"kd_loss": kd.item(), "lm_loss": lm.item()}

    return loss


def reference_distillation_loss(teacher: torch.nn.Module, temperature: float, kd_weight: float, lm_weight: float):
    """The same loss written out with autograd over both models' full logits: what distillation_loss must equal
    (tests/test_distill_head.py) and what benchmarks/recover_throughput.py times it against."""
    teacher.eval()

    def loss(student: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
        logits, _ = student(x)
        with torch.no_grad():
            teacher_logits, _ = teacher(x)
        vocab = logits.size(-1)
        lm = F.cross_entropy(logits.view(-1, vocab).float(), y.reshape(-1))
        kd = F.kl_div(F.log_softmax(logits.view(-1, vocab).float() / temperature, dim=-1),
                      F.log_softmax(teacher_logits.view(-1, vocab).float() / temperature, dim=-1),
                      log_target=True, reduction="batchmean") * temperature**2
        return kd_weight * kd + lm_weight * lm, {"kd_loss": kd.item(), "lm_loss": lm.item()}

    return loss
