"""Checkpoint I/O: safetensors weights + JSON config, verified on load.

A model folder holds ``model.safetensors`` and ``config.json`` in transformers' layout (see
models/hf_format.py). Folders written by earlier versions (cpuforge's own config.json, with the
model under "model", and cpuforge's tensor names) still load. A training checkpoint adds
``optimizer.pt`` and ``trainer.pt`` (loaded with ``weights_only=True``) and, written last,
``manifest.json`` with each file's size and sha256: a checkpoint without a manifest, or whose
files do not match it, is incomplete or corrupted and is never resumed from.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from cpuforge.models.config import LlamaConfig, ModelConfigError
from cpuforge.models.fileio import atomic_write_json, fsync_dir, sha256_file
from cpuforge.models.hf_format import (
    UnsupportedModel,
    config_from_hf,
    from_hf_names,
    hf_config,
    is_hf_config,
    to_hf_names,
)
from cpuforge.models.llama import Llama

log = logging.getLogger("cpuforge.checkpoint")

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
OPTIMIZER = "optimizer.pt"
TRAINER = "trainer.pt"
MANIFEST = "manifest.json"
FORMAT = 1  # of the training checkpoint's manifest, and of the config.json folders used to have
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, corrupted or made for another model."""


def save_model(model: Llama, folder: Path, extra: dict[str, Any] | None = None,
               weights: dict[str, torch.Tensor] | None = None) -> None:
    """Weights (the model's own, or ``weights``: e.g. gathered from shards) + config.json into folder,
    as transformers' save_pretrained lays them out (``extra``: cpuforge's notes, under "cpuforge")."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in (model.state_dict() if weights is None else weights).items()}
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight")  # the same tensor as tok_emb.weight
    save_file(to_hf_names(state), str(folder / WEIGHTS), metadata={"format": "pt"})
    atomic_write_json(folder / CONFIG, hf_config(model.cfg, extra))


def read_config(folder: Path) -> LlamaConfig:
    path = folder / CONFIG
    if not path.is_file():
        raise CheckpointError(f"{folder} is not a cpuforge checkpoint: {CONFIG} is missing")
    try:
        data = json.loads(path.read_text())
        return config_from_hf(data) if is_hf_config(data) else LlamaConfig.from_dict(data["model"])
    except UnsupportedModel as exc:
        raise CheckpointError(f"{folder}: unsupported model: {exc}") from None
    except (json.JSONDecodeError, KeyError, TypeError, ModelConfigError) as exc:
        raise CheckpointError(f"{path} is not a valid model config: {exc}") from None


def load_model(folder: Path, expect: LlamaConfig | None = None, max_context: int | None = None) -> Llama:
    """Load and verify a model folder; `expect` rejects a checkpoint made for another config. `max_context`
    cuts a longer context (a transformers model's thousands of tokens) to the one used here: no weight
    depends on it, the rotary tables are computed for it."""
    folder = Path(folder)
    cfg = read_config(folder)
    if max_context is not None and cfg.block_size > max_context:
        cfg = replace(cfg, block_size=max_context)
    if expect is not None:
        _check_same_config(folder, cfg, expect)
    model = Llama(cfg)
    _load_verified_weights(model, folder)
    return model


def load_weights_into(model: Llama, folder: Path) -> None:
    """Load a checkpoint's weights into a model of the same config (resume: no second model built)."""
    _check_same_config(folder, read_config(folder), model.cfg)
    _load_verified_weights(model, folder)


def _check_same_config(folder: Path, found: LlamaConfig, expect: LlamaConfig) -> None:
    if found != expect:
        diff = {k: (v, getattr(expect, k)) for k, v in found.to_dict().items() if getattr(expect, k) != v}
        raise CheckpointError(
            f"{folder} was made for another model: "
            + ", ".join(f"{k}={a} (expected {b})" for k, (a, b) in diff.items())
        )


def _load_verified_weights(model: Llama, folder: Path) -> None:
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{folder}: {WEIGHTS} is missing")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise CheckpointError(f"{weights} is truncated or corrupted ({exc})") from None
    state = from_hf_names(state)  # a folder written by an earlier version has cpuforge's names already
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight", None)  # some writers save the tied head too
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if model.cfg.tie_embeddings:
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{k}: {tuple(state[k].shape)} vs {tuple(s)}" for k, s in expected.items() if k in state and state[k].shape != s]
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"{weights} does not match its config: "
            + "; ".join(filter(None, [
                f"missing {', '.join(missing[:5])}" if missing else "",
                f"unexpected {', '.join(unexpected[:5])}" if unexpected else "",
                f"shape mismatch {', '.join(wrong[:5])}" if wrong else "",
            ]))
        )
    model.load_state_dict(state, strict=False)  # lm_head.weight is tied to tok_emb.weight


def save_training_checkpoint(root: Path, step: int, model: Llama, optimizer_state: dict[str, Any],
                             trainer_state: dict[str, Any], keep: int = 2) -> Path:
    """Write step-N atomically (temp folder + manifest + rename) and keep the newest `keep`."""
    tmp = checkpoint_tmp_dir(root, step)
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tmp)
    torch.save(optimizer_state, tmp / OPTIMIZER)
    return finish_checkpoint(root, step, tmp, model.cfg, trainer_state, keep)


def checkpoint_tmp_dir(root: Path, step: int) -> Path:
    return root / f".step-{step:08d}.tmp"


def finish_checkpoint(root: Path, step: int, tmp: Path, cfg: LlamaConfig, trainer_state: dict[str, Any],
                      keep: int = 2) -> Path:
    """Complete a checkpoint whose weights and optimizer state are in `tmp` (full files, or the shards
    torch.distributed.checkpoint wrote): config, trainer state, a manifest of every file, rename."""
    if not (tmp / CONFIG).is_file():
        atomic_write_json(tmp / CONFIG, hf_config(cfg))
    torch.save(trainer_state, tmp / TRAINER)
    files = {str(path.relative_to(tmp)): {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
             for path in sorted(tmp.rglob("*")) if path.is_file() and path.name != MANIFEST}
    atomic_write_json(tmp / MANIFEST, {"format": FORMAT, "step": step, "files": files})
    fsync_dir(tmp)
    final = root / f"step-{step:08d}"
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(root)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def verify_checkpoint(folder: Path) -> None:
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{folder}: no {MANIFEST} (the checkpoint was never completed)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError:
        raise CheckpointError(f"{manifest_path} is corrupted") from None
    for name, expected in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{folder}: {name} is missing")
        if path.stat().st_size != expected["bytes"] or sha256_file(path) != expected["sha256"]:
            raise CheckpointError(f"{folder}: {name} is truncated or corrupted (checksum mismatch)")


def latest_valid_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint that verifies; a corrupted newer one is skipped with a warning."""
    for folder in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(folder)
            return folder
        except CheckpointError as exc:
            log.warning("skipping checkpoint: %s; trying the previous one", exc)
    return None


def load_training_state(folder: Path) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(optimizer state, trainer state), loaded without executing any pickled code. The optimizer
    state is None in a sharded checkpoint (it is in the shards: tasks/engine/sharding.py)."""
    try:
        optimizer = torch.load(folder / OPTIMIZER, weights_only=True) if (folder / OPTIMIZER).is_file() else None
        trainer = torch.load(folder / TRAINER, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{folder}: cannot read the training state ({exc})") from None
    return optimizer, trainer
