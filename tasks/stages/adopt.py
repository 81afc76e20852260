"""Stage 2 of the compression flow, adopt: an existing pretrained model takes the place of pretraining.

The model (a folder, a run's artifact, the champion's pretrained weights, or a transformers Llama
checkpoint: see tasks/release/lineage.py) is written into the store as ``model/`` in cpuforge's layout
(float32, with its tokenizer and a model card) and scored on the val split exactly as pretraining scores
its own, so prune, recover and evaluate see the same kind of record either way.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from cpuforge.models.checkpoint import CheckpointError, load_model, save_model
from cpuforge.models.hf_format import write_tokenizer
from cpuforge.models.llama import config_param_count
from cpuforge.tasks import stages
from cpuforge.tasks.config.settings import ModelConfig, TrainConfig
from cpuforge.tasks.engine.data import open_shards, token_byte_lengths, unigram_bpb, val_batches
from cpuforge.tasks.engine.validation import evaluate
from cpuforge.tasks.infra.stage import StageOutput, StageRun, key_config
from cpuforge.tasks.infra.store import StageRecord
from cpuforge.tasks.records.errors import ModelError
from cpuforge.tasks.release.lineage import PretrainedSource
from cpuforge.tasks.release.model_card import made_by, write_model_card

SPEC = stages.ADOPT


def work(run: StageRun, model: ModelConfig, train: TrainConfig) -> StageOutput:
    return adopt(model, train, run.inputs["tokenize"], run.source, run.out_dir)


def adopt(m: ModelConfig, t: TrainConfig, tokenized: StageRecord, source: PretrainedSource, out_dir: Path) -> StageOutput:
    started = time.perf_counter()
    model_dir = out_dir / "model"
    try:
        model = load_model(Path(source.folder), max_context=m.block_size)  # a transformers model's context, cut
    except CheckpointError as exc:
        raise ModelError(f"{source.origin}: {exc}") from None
    shards = open_shards(Path(tokenized.output_dir), model.cfg.block_size)
    if shards.vocab_size != model.cfg.vocab_size:
        raise ModelError(f"{source.origin}: the model has {model.cfg.vocab_size} token ids but its tokenizer "
                         f"{shards.vocab_size}: the folder's tokenizer.json is not the one it was trained with")
    save_model(model, model_dir)
    write_tokenizer(model_dir, shards.tokenizer_path, shards.meta["eod_token"], shards.eod_id)
    lengths = token_byte_lengths(shards.tokenizer_path)
    with torch.no_grad():
        val_loss, val_bpb = evaluate(model, val_batches(shards.val, t.eval_batches, t.batch_size,
                                                        model.cfg.block_size), lengths)
    metrics = {
        "params": config_param_count(model.cfg), "val_loss": round(val_loss, 4), "val_bpb": round(val_bpb, 4),
        "unigram_bpb": round(unigram_bpb(shards.train, shards.val, shards.vocab_size, lengths), 4),
        "seconds": round(time.perf_counter() - started, 2),
    }
    write_model_card(model_dir, [*made_by(tokenized), (SPEC.name, {"model": key_config("model", m), "train": key_config("train", t)})],
                     tokenized, metrics, source.origin)
    return StageOutput(metrics=metrics, files={"model": "model", "tokenizer": "model/tokenizer.json"},
                       artifacts=["model"], info={"source": source.as_dict(), "model_config": model.cfg.to_dict()})
