"""What a training stage shows people: its loss curve. (Samples from fixed prompts are evaluate's,
for every variant with the same seed: a report setting never retrains a model.)"""

from __future__ import annotations

import json
from pathlib import Path

SAMPLE_SEED = 1234


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




def training_reports(out_dir: Path) -> None:
    """After a training stage: loss_curve.png from history.jsonl."""
    history = [json.loads(line) for line in (out_dir / "history.jsonl").read_text().splitlines()]
    plot_loss_curve(history, out_dir / "loss_curve.png")
