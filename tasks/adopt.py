"""Stage 2 of the compression flow, adopt: an existing pretrained model takes the place of pretraining.

The model (a folder, a run's artifact, or the champion's pretrained weights: see tasks/lineage.py)
is copied into the store as ``model/`` and scored on the val split exactly as pretraining scores
its own, so prune, recover and evaluate see the same kind of record either way.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from cpuforge.models.checkpoint import load_model
from cpuforge.models.llama import config_param_count
from cpuforge.tasks import stages
from cpuforge.tasks.config import TrainConfig
from cpuforge.tasks.engine.data import open_shards, token_byte_lengths, unigram_bpb, val_batches
from cpuforge.tasks.engine.trainer import evaluate
from cpuforge.tasks.errors import ModelError
from cpuforge.tasks.infra.stage import StageOutput, StageRun
from cpuforge.tasks.infra.store import StageRecord
from cpuforge.tasks.lineage import MODEL_FILES, PretrainedSource

SPEC = stages.ADOPT


def work(run: StageRun, train: TrainConfig) -> StageOutput:
    return adopt(train, run.inputs["tokenize"], run.source, run.out_dir)


def adopt(t: TrainConfig, tokenized: StageRecord, source: PretrainedSource, out_dir: Path) -> StageOutput:
    started = time.perf_counter()
    model_dir = out_dir / "model"
    model_dir.mkdir(exist_ok=True)
    for name in MODEL_FILES:
        shutil.copy(Path(source.folder) / name, model_dir / name)
    model = load_model(model_dir)
    shards = open_shards(Path(tokenized.output_dir), model.cfg.block_size)
    if shards.vocab_size != model.cfg.vocab_size:
        raise ModelError(f"{source.origin}: the model has {model.cfg.vocab_size} token ids but its tokenizer "
                         f"{shards.vocab_size}: the folder's tokenizer.json is not the one it was trained with")
    lengths = token_byte_lengths(shards.tokenizer_path)
    with torch.no_grad():
        val_loss, val_bpb = evaluate(model, val_batches(shards.val, t.eval_batches, t.batch_size,
                                                        model.cfg.block_size), lengths)
    metrics = {
        "params": config_param_count(model.cfg), "val_loss": round(val_loss, 4), "val_bpb": round(val_bpb, 4),
        "unigram_bpb": round(unigram_bpb(shards.train, shards.val, shards.vocab_size, lengths), 4),
        "seconds": round(time.perf_counter() - started, 2),
    }
    return StageOutput(metrics=metrics, files={"model": "model", "tokenizer": "model/tokenizer.json"},
                       artifacts=["model"], info={"source": source.as_dict(), "model_config": model.cfg.to_dict()})
