"""Muon for the hidden weight matrices, AdamW for everything else, as one optimizer.

Muon (Keller Jordan, 2024; "Muon is Scalable for LLM Training", Moonshot 2025) replaces each
matrix's momentum update by its nearest semi-orthogonal matrix (a quintic Newton-Schulz
iteration), so every direction of the matrix moves at the same rate. It suits the 2-D weights
inside the blocks; embeddings, the LM head and the norms' gains stay on AdamW.

Why not `torch.optim.Muon` itself: its Newton-Schulz runs in bf16, which on a CPU without
native bf16 is ~100x slower than fp32 (a demo-size step would spend seconds in it). This one
runs the iteration in `ns_dtype`: the dtype the training step runs in where the CPU has native
bf16 (1.09x a bf16 demo Muon step over fp32 Newton-Schulz on AVX-512/AMX), fp32 everywhere
else (optimizers.newton_schulz_dtype). It uses the same coefficients, momentum and
"match_rms_adamw" learning-rate adjustment (0.2 * sqrt(max(rows, cols))): that adjustment
gives updates of the RMS AdamW's have, so Muon's learning rate and weight decay sit on AdamW's
scale. One optimizer (not two) keeps checkpoints, resume and DDP code unchanged: its state is
keyed by parameter like any torch optimizer's.
"""

from __future__ import annotations

import math

import torch

# torch.optim.Muon's quintic coefficients (tuned for the fastest rise of small singular values).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def orthogonalize(g: torch.Tensor, steps: int = 5, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An approximately semi-orthogonal matrix with g's singular vectors (Newton-Schulz), iterated in
    `dtype` (g's own by default) and returned in g's."""
    a, b, c = NS_COEFFICIENTS
    x = g.T if g.size(0) > g.size(1) else g  # iterate on the short side: X X^T is the small Gram matrix
    x = x.to(dtype or g.dtype)
    x = x / x.norm().clamp(min=NS_EPS)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if g.size(0) > g.size(1) else x).to(g.dtype)


class MuonAdamW(torch.optim.Optimizer):
    """Each param group says its rule: ``use_muon`` True (2-D matrices: lr, weight_decay, momentum,
    nesterov, ns_steps) or False (AdamW: lr, weight_decay, betas, eps)."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 ns_dtype: torch.dtype = torch.float32) -> None:
        defaults = dict(lr=lr, weight_decay=0.0, betas=betas, eps=eps, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, use_muon=False)
        super().__init__(groups, defaults)
        self.ns_dtype = ns_dtype  # not a group setting: the checkpointed state stays plain tensors and numbers
        for group in self.param_groups:
            if group["use_muon"] and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon updates 2-D matrices only; put other parameters in an AdamW group")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (self._muon if group["use_muon"] else self._adamw)(group)
        return loss

    def _muon(self, group: dict) -> None:
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
            update = orthogonalize(update, group["ns_steps"], self.ns_dtype)
            p.mul_(1 - lr * wd)
            p.add_(update, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))

    def _adamw(self, group: dict) -> None:
        lr, wd, (beta1, beta2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:  # the layout torch.optim.AdamW uses, so the state reads the same
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            t = state["step"].item()
            state["exp_avg"].lerp_(p.grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
            p.mul_(1 - lr * wd)
            p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**t))
