"""Shared by the training benchmarks: train once from a config, in a fresh process or under torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cpuforge.tasks.config import Config
from cpuforge.tasks.engine.training_run import launch_torchrun


def train_standalone(cfg: Config, tokenize_dir: Path, out: Path, world: int) -> Path:
    """Pretrain as the pipeline would (no MLflow), under torchrun when world > 1; returns out."""
    out.mkdir()
    spec = {"kind": "pretrain", "config": cfg.model_dump(mode="json"), "tokenize_dir": str(tokenize_dir),
            "out_dir": str(out), "threads": cfg.train.threads, "dtype": "float32", "peak_flops": 0.0,
            "tracking_uri": "", "run_id": None}
    (out / "launch.json").write_text(json.dumps(spec))
    if world > 1:
        launch_torchrun(cfg, out / "launch.json", "bench")
    else:
        code = "import json,sys; from cpuforge.tasks.engine.training_run import run_training; run_training(json.load(open(sys.argv[1])))"
        subprocess.run([sys.executable, "-c", code, str(out / "launch.json")], check=True)
    return out
