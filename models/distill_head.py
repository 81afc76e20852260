"""Distillation's loss at the LM head, fused: the student's and the teacher's logits, the KL between them, the
student's cross-entropy and the gradients, one slice of tokens at a time.

Written out with autograd, a distillation step materialises the whole batch's logits several times over for
both models (logits, their fp32 copies, two log-softmaxes, the KL's terms, and each one's gradient): at a
49,152-token vocabulary and 2,048 tokens a step that is ~400 MB a tensor and half the step's time on 2 cores.
Here each slice's logits are made, reduced to the loss and to their gradient (the softmax identities below),
and pushed through the head's two matmuls at once; what backward needs is the gradient for the hidden states
(tokens x d_model) and for the head's weight (vocab x d_model), nothing of vocabulary x tokens. Liger Kernel's
fused linear cross-entropy / JSD do this for GPUs (Triton); this is the same idea in plain PyTorch for the CPU.

With temperature T, student logits z, teacher logits u, p = softmax(z / T), q = softmax(u / T), s = softmax(z):
    kd = T^2 * KL(q || p),   d kd / dz = T * (p - q)
    lm = -log s[target],     d lm / dz = s - onehot(target)
both averaged over tokens, as F.kl_div(reduction="batchmean") and F.cross_entropy compute them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Elements of a slice's logits: 2^23 fp32 values, 32 MB a tensor (~170 tokens at a 49k vocabulary). Large enough
# for the head's matmuls to run at full speed; no larger, because glibc's malloc keeps blocks up to 32 MB for reuse
# under the trainer's settings (tasks/engine/allocator.py) and maps and page-faults larger ones every slice. The
# 135M shape's head loss (2,048 tokens, bf16) took 1.31 s at 2^23, 1.81 s at 2^24 and 1.67 s at 2^22.
SLICE_ELEMENTS = 1 << 23


class Distillation(NamedTuple):
    """What the student's forward needs to compute the distillation loss at its head (Llama.forward(distill=)):
    the teacher's final hidden states (after its norm) for the same tokens, its LM head's weight, and the
    loss's settings."""

    teacher_hidden: torch.Tensor
    teacher_head: torch.Tensor
    temperature: float = 1.0
    kd_weight: float = 1.0
    lm_weight: float = 0.0


def _compute_dtype() -> torch.dtype:
    """bf16 under CPU autocast (the head's matmuls as autocast would run them), else fp32."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32


class _FusedDistillation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, head, targets, teacher_hidden, teacher_head, temperature, kd_weight, lm_weight):
        dtype = _compute_dtype()
        with torch.autocast("cpu", enabled=False):
            h = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
            ht = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).to(dtype)
            y = targets.reshape(-1)
            w, wt = head.to(dtype), teacher_head.to(dtype)
            n, vocab = h.shape[0], w.shape[0]
            rows = max(1, SLICE_ELEMENTS // vocab)
            grad_h = torch.empty(h.shape, dtype=torch.float32)
            grad_w = torch.zeros(head.shape, dtype=torch.float32)
            kd_sum = torch.zeros((), dtype=torch.float64)
            lm_sum = torch.zeros((), dtype=torch.float64)
            T = float(temperature)
            for lo in range(0, n, rows):
                hi = min(n, lo + rows)
                h_part, y_part = h[lo:hi], y[lo:hi]
                z = (h_part @ w.T).float()
                u = (ht[lo:hi] @ wt.T).float()  # (forward runs without autograd: nothing here is recorded)
                log_q = torch.log_softmax(u.div_(T) if T != 1.0 else u, -1)
                del u
                q = log_q.exp()
                log_p = None if T == 1.0 else torch.log_softmax(z / T, -1)
                log_s = torch.log_softmax(z, -1)
                del z
                if log_p is None:  # p is s: one softmax serves both terms
                    log_p = log_s
                kd_sum += torch.sub(log_q, log_p).mul_(q).sum(dtype=torch.float64)
                lm_sum -= log_s.gather(1, y_part[:, None]).sum(dtype=torch.float64)
                if log_p is log_s:  # grad = (kd_weight + lm_weight) s - kd_weight q - lm_weight onehot
                    grad = log_s.exp_().mul_(kd_weight + lm_weight).sub_(q, alpha=kd_weight)
                else:  # grad = kd_weight T (p - q) + lm_weight (s - onehot)
                    grad = log_p.exp_().sub_(q).mul_(kd_weight * T).add_(log_s.exp_(), alpha=lm_weight)
                grad[torch.arange(hi - lo), y_part] -= lm_weight
                g = grad.to(dtype)
                grad_h[lo:hi] = g @ w
                grad_w += g.T @ h_part
            kd = (kd_sum * T * T / n).float()
            lm = (lm_sum / n).float()
            total = kd_weight * kd + lm_weight * lm
        ctx.save_for_backward(grad_h, grad_w)
        ctx.n, ctx.hidden_shape, ctx.hidden_dtype = n, hidden.shape, hidden.dtype
        ctx.mark_non_differentiable(kd, lm)
        return total, kd, lm

    @staticmethod
    def backward(ctx, grad_total, _grad_kd, _grad_lm):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_total / ctx.n
        return ((grad_h * scale).view(ctx.hidden_shape).to(ctx.hidden_dtype), grad_w * scale,
                None, None, None, None, None, None)


def distillation_head_loss(hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor,
                           distill: Distillation) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kd_weight * kd + lm_weight * lm, kd, lm) for the student's final hidden states (after its norm) and LM head
    weight; only the first carries a gradient (to both). Matmuls in bf16 under CPU autocast, softmaxes in fp32."""
    return _FusedDistillation.apply(hidden, head, targets, distill.teacher_hidden, distill.teacher_head,
                                    distill.temperature, distill.kd_weight, distill.lm_weight)


def keep_out_of_compile() -> None:
    """Make torch.compile call distillation_head_loss eagerly: traced, its loop over slices would unroll, one copy
    per slice, and what it runs (matmuls, single-pass softmaxes) compile would not speed up. Llama.compile_forward
    does this before compiling rather than a decorator at import: torch.compiler.disable imports torch._dynamo,
    2.5 s that every process importing the model would pay (evaluate's measuring processes, one per variant)."""
    global distillation_head_loss
    if not getattr(distillation_head_loss, "_torchdynamo_disable", False):
        distillation_head_loss = torch.compiler.disable(distillation_head_loss)
