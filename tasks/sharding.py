"""How the model is spread over training processes, and the strategy-free state checkpoints hold.

- one process: the plain model;
- DDP (``train.strategy=ddp``): a full replica per process, gradients averaged over gloo;
- FSDP (``train.strategy=fsdp``): PyTorch's fully_shard on every decoder block and the root, so
  parameters, gradients and AdamW moments are split across the processes (each holds ~1/N of
  the 16 bytes per parameter) and gathered block by block for compute.

Checkpoints always hold the *full* state: weights as safetensors and the optimizer state keyed by
parameter name (torch.distributed.checkpoint's full state dicts), gathered to rank 0 when sharded.
So a checkpoint written under any strategy resumes under any other, on any number of processes.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard

from models.llama import Llama

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def shard(model: Llama) -> None:
    """FSDP: shard each block, then the root (embedding, final norm, LM head), in place."""
    # FSDP warns that a block returns views: those are the KV-cache tensors, which training never
    # modifies in place (the case the warning is about).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def full_weights(model: Llama) -> dict[str, torch.Tensor]:
    """The whole model's weights (on rank 0 when sharded: every rank must call it, it gathers)."""
    return get_model_state_dict(model, options=FULL) if is_sharded(model) else model.state_dict()


def full_optimizer_state(model: Llama, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state keyed by parameter name, as any strategy can load it (gathers when sharded)."""
    return get_optimizer_state_dict(model, optimizer, options=FULL)


def load_optimizer_state(model: Llama, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    if state.get("state") and all(isinstance(k, int) for k in state["state"]):
        optimizer.load_state_dict(state)  # a checkpoint from before states were keyed by name
    else:
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def gradient_sync(net: torch.nn.Module, sync: bool):
    """Skip the gradient all-reduce (DDP) or reduce-scatter (FSDP) on all but the last micro-batch."""
    if sync:
        return contextlib.nullcontext()
    if is_sharded(net):
        return _fsdp_no_sync(net)
    return net.no_sync() if hasattr(net, "no_sync") else contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(net: FSDPModule):
    net.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        net.set_requires_gradient_sync(True)


def as_float(value: torch.Tensor) -> float:
    """A scalar that may be a DTensor (FSDP's gradient norm)."""
    return float(value.full_tensor() if hasattr(value, "full_tensor") else value)
