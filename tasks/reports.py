"""What a stage shows people about a model: samples from fixed prompts and loss curves."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from cpuforge.models.checkpoint import load_model
from cpuforge.models.fileio import atomic_write_text
from cpuforge.models.llama import Llama
from cpuforge.models.runtime import generate
from cpuforge.tasks.config import Config

SAMPLE_SEED = 1234


def write_samples(model: Llama, tokenizer: Tokenizer, cfg: Config, eod_id: int) -> str:
    generator = torch.Generator().manual_seed(SAMPLE_SEED)
    tokenizer.encode_special_tokens = True
    parts = []
    for prompt in cfg.eval.prompts:
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids[: model.cfg.block_size - 1] or [eod_id]
        out = list(generate(model, ids, cfg.eval.max_new_tokens, temperature=0.8, top_k=40, stop_token=eod_id,
                            generator=generator))
        parts.append(f"=== prompt: {prompt!r}\n{prompt}{tokenizer.decode(out)}\n")
    return "\n".join(parts)


def plot_loss_curve(history: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="train loss", lw=1)
    evals = [h for h in history if "val_loss" in h]
    ax.plot([h["step"] for h in evals], [h["val_loss"] for h in evals], "o-", label="val loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)




def samples_from_folder(model_dir: Path, cfg: Config, eod_id: int) -> str:
    """Reload a saved model folder (proving it loads alone) and sample from it."""
    model = load_model(model_dir)
    return write_samples(model, Tokenizer.from_file(str(model_dir / "tokenizer.json")), cfg, eod_id)


def training_reports(out_dir: Path, cfg: Config, eod_id: int) -> None:
    """After a training stage: samples.txt from the saved model/, loss_curve.png from history.jsonl."""
    atomic_write_text(out_dir / "samples.txt", samples_from_folder(out_dir / "model", cfg, eod_id))
    history = [json.loads(line) for line in (out_dir / "history.jsonl").read_text().splitlines()]
    plot_loss_curve(history, out_dir / "loss_curve.png")
