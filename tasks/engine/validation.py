"""A model's validation loss and bits per byte over fixed batches: the trainer's periodic evaluation,
and the before/after figures of prune and adopt (which train nothing, so they import this and not the
trainer, and the trainer stays out of their code hash)."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F

from cpuforge.models.llama import Llama
from cpuforge.tasks.engine.data import bits_per_byte


@torch.no_grad()
def evaluate(model: Llama, batches: list[tuple[torch.Tensor, torch.Tensor]], byte_lengths: np.ndarray,
             dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """(mean loss per token, bits per byte) over fixed validation batches."""
    was_training = model.training
    model.eval()
    nll, tokens, n_bytes = 0.0, 0, 0
    lengths = torch.from_numpy(byte_lengths)
    for x, y in batches:
        # Eager under train.compile too: evaluation is ~5% of a run's steps, not worth a second graph's compile.
        with autocast(dtype), torch.compiler.set_stance("force_eager"):
            logits, _ = model(x)
        nll += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1), reduction="sum").item()
        tokens += y.numel()
        n_bytes += int(lengths[y].sum())
    model.train(was_training)
    return nll / tokens, bits_per_byte(nll, n_bytes)


def autocast(dtype: torch.dtype):
    if dtype == torch.bfloat16:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()
