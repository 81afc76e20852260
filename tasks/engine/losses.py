"""The training losses, shared by the trainer and the step timers (step_timing.training_step_timer), so
that what is timed is what is trained. A leaf module: torch only."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, targets=y)[0]  # through forward (and so DDP/FSDP/compile): Llama's sliced cross-entropy


def distillation_loss(teacher: torch.nn.Module, temperature: float, kd_weight: float, lm_weight: float):
    """Knowledge distillation: KL to the teacher's softened distribution plus the usual LM loss."""
    teacher.eval()

    def loss(student: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
        logits, _ = student(x)
        with torch.no_grad():
            teacher_logits, _ = teacher(x)
        vocab = logits.size(-1)
        lm = F.cross_entropy(logits.view(-1, vocab), y.reshape(-1))
        kd = F.kl_div(F.log_softmax(logits.view(-1, vocab) / temperature, dim=-1),
                      F.log_softmax(teacher_logits.view(-1, vocab) / temperature, dim=-1),
                      log_target=True, reduction="batchmean") * temperature**2
        return kd_weight * kd + lm_weight * lm, {"kd_loss": kd.item(), "lm_loss": lm.item()}

    return loss
