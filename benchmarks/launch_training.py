"""Shared by the training benchmarks: train once from a config, in a fresh process or under torchrun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cpuforge.tasks.config.settings import Config
from cpuforge.tasks.engine.data import open_shards
from cpuforge.tasks.engine.training_run import TrainingSpec, launch_torchrun, threads_per_process


def train_standalone(cfg: Config, tokenize_dir: Path, out: Path, world: int) -> Path:
    """Pretrain as the pipeline would (no MLflow), under torchrun when world > 1; returns out."""
    out.mkdir()
    cfg = cfg.model_copy(update={"model": cfg.model.or_named("demo")})  # model.size=auto: the demo's shape
    vocab = open_shards(tokenize_dir, cfg.model.block_size).vocab_size
    spec = TrainingSpec(kind="pretrain", train=cfg.train, model=cfg.model.shape(vocab), tokenize_dir=str(tokenize_dir),
                        out_dir=str(out), threads=threads_per_process(cfg.train))
    (out / "launch.json").write_text(spec.model_dump_json())
    if world > 1:
        launch_torchrun(cfg.train, out / "launch.json", "bench")
    else:
        code = "import json,sys; from cpuforge.tasks.engine.training_run import run_training; run_training(json.load(open(sys.argv[1])))"
        subprocess.run([sys.executable, "-c", code, str(out / "launch.json")], check=True)
    return out
