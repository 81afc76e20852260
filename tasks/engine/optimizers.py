"""The optimizers a training step runs: AdamW, or Muon for the blocks' matrices with AdamW for the rest.
One builder, so that the trainer and the step timers (precision A/B, model sizing) time the same thing."""

from __future__ import annotations

import torch

from cpuforge.tasks.engine import hardware
from cpuforge.tasks.engine.muon import MuonAdamW


def newton_schulz_dtype(step_dtype: torch.dtype) -> torch.dtype:
    """Muon's Newton-Schulz runs in the step's precision where the CPU has native bf16 (1.09x a bf16 demo
    step on AVX-512/AMX); elsewhere in fp32, also under a forced train.precision=bf16 (emulated bf16
    matmuls are ~100x slower)."""
    return step_dtype if step_dtype == torch.float32 or hardware.has_native_bf16() else torch.float32


def build_optimizer(model: torch.nn.Module, optimizer: str, lr: float, muon_lr: float = 0.0,
                    weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95),
                    ns_dtype: torch.dtype = torch.float32) -> torch.optim.Optimizer:
    """Weight decay on matrices only (not norms); one parameter per tied pair. With optimizer=muon the
    blocks' matrices go to Muon and the rest (embedding/LM head, norms) to AdamW. A group's
    ``lr_ratio`` is its peak learning rate over train.lr: the schedule scales every group alike.
    Muon's Newton-Schulz runs in `ns_dtype` (newton_schulz_dtype of the step's precision).
    AdamW is foreach, not fused: the fused CPU kernel was no faster on a demo step (0.97-1.03x,
    benchmarks/train_levers.py)."""
    named = list({id(p): (n, p) for n, p in model.named_parameters() if p.requires_grad}.values())
    params = [p for _, p in named]
    no_decay = [p for p in params if p.dim() < 2]
    if optimizer == "muon":
        muon_lr = muon_lr or lr
        hidden = [p for n, p in named if p.dim() == 2 and n.startswith("blocks.")]
        other = [p for n, p in named if p.dim() >= 2 and not n.startswith("blocks.")]
        groups = [{"params": hidden, "weight_decay": weight_decay, "use_muon": True, "lr": muon_lr,
                   "lr_ratio": muon_lr / lr},
                  {"params": other, "weight_decay": weight_decay, "lr_ratio": 1.0},
                  {"params": no_decay, "weight_decay": 0.0, "lr_ratio": 1.0}]
        return MuonAdamW(groups, lr=lr, betas=betas, ns_dtype=ns_dtype)
    decay = [p for p in params if p.dim() >= 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=True)
