"""How the model is spread over training processes, and the strategy-free state checkpoints hold.

- one process: the plain model;
- DDP (``train.strategy=ddp``): a full replica per process, gradients averaged over gloo;
- FSDP (``train.strategy=fsdp``): PyTorch's fully_shard on every decoder block and the root, so
  parameters, gradients and AdamW moments are split across the processes (each holds ~1/N of
  the 16 bytes per parameter) and gathered block by block for compute.

Checkpoints of one process or DDP hold the full state: weights as safetensors and the optimizer
state keyed by parameter name. FSDP checkpoints are sharded: every rank writes its own part with
torch.distributed.checkpoint (nothing is gathered, so rank 0 never holds the whole training state),
and loading reshards to whatever the reader runs: one process, DDP, or FSDP on any number of
processes. So a checkpoint written under any strategy resumes under any other.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard

from cpuforge.models.checkpoint import CheckpointError, checkpoint_tmp_dir, finish_checkpoint
from cpuforge.models.llama import Llama
from cpuforge.tasks.engine.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
SHARDS = "shards"  # the torch.distributed.checkpoint folder inside a sharded checkpoint


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


def is_sharded_checkpoint(folder: Path) -> bool:
    return (folder / SHARDS).is_dir()


def save_sharded_checkpoint(root: Path, step: int, model: Llama, optimizer: torch.optim.Optimizer,
                            trainer_state: dict[str, Any], keep: int = 2) -> None:
    """Every rank writes its shards of the weights and optimizer state; rank 0 completes the checkpoint
    (config, trainer state, manifest, atomic rename) once all have. Collective: every rank calls it."""
    tmp = checkpoint_tmp_dir(root, step)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=str(tmp / SHARDS))
    dist.barrier()
    if dist.get_rank() == 0:
        finish_checkpoint(root, step, tmp, model.cfg, trainer_state, keep)
    dist.barrier()


def load_sharded_checkpoint(model: Llama, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Load a sharded checkpoint into this run's model and optimizer, whatever their layout. `folder`
    has passed verify_checkpoint (latest_valid_checkpoint); nothing in it is unpickled as code."""
    _create_optimizer_state(model, optimizer)  # the template torch.distributed.checkpoint fills in
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    with warnings.catch_warnings():  # one process reading every shard is what we mean here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(folder / SHARDS), planner=SafeLoadPlanner())
        except CheckpointException as exc:  # a BaseException wrapping each rank's failure
            causes = [failure[0] if isinstance(failure, tuple) else failure for failure in exc.failures.values()]
            raise CheckpointError(f"{folder}: cannot load its shards: {causes[0] if causes else exc}") from None
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])


def _create_optimizer_state(model: Llama, optimizer: torch.optim.Optimizer) -> None:
    """AdamW creates its moments at the first step; make them now with a step that changes nothing
    (zero gradients, learning rate 0), so they exist to be overwritten by the loaded ones."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
