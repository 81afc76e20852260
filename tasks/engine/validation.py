"""A model's validation loss and bits per byte over fixed batches: the trainer's periodic evaluation,
and the before/after figures of prune and adopt (which train nothing, so they import this and not the
trainer, and the trainer stays out of their code hash)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch

from cpuforge.models.llama import Llama
from cpuforge.tasks.engine.data import bits_per_byte


@torch.no_grad()
def evaluate(model: Llama, batches: list[tuple[torch.Tensor, torch.Tensor]], byte_lengths: np.ndarray,
             dtype: torch.dtype = torch.float32, on_batch: Callable[[], None] | None = None) -> tuple[float, float]:
    """(mean loss per token, bits per byte) over fixed validation batches; `on_batch()` after each."""
    was_training = model.training
    model.eval()
    nll, tokens, n_bytes = 0.0, 0, 0
    lengths = torch.from_numpy(byte_lengths)
    for x, y in batches:
        # Eager under train.compile too: evaluation is ~5% of a run's steps, not worth a second graph's compile.
        # Through forward(targets=): the LM head and cross-entropy in slices, never the whole (batch, context,
        # vocab) logits at once (1.6 GB in fp32 for a 49k vocabulary at 8 x 1024).
        with autocast(dtype), torch.compiler.set_stance("force_eager"):
            mean_nll, _ = model(x, targets=y)
        nll += mean_nll.item() * y.numel()
        tokens += y.numel()
        n_bytes += int(lengths[y].sum())
        if on_batch is not None:
            on_batch()
    model.train(was_training)
    return nll / tokens, bits_per_byte(nll, n_bytes)


def autocast(dtype: torch.dtype):
    if dtype == torch.bfloat16:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()
