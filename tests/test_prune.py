"""Structured pruning and distillation: surgery, targets, importance vs random, bad input."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from cpuforge.models.checkpoint import load_model, save_model
from cpuforge.models.config import LlamaConfig
from cpuforge.models.importance import activation_importance
from cpuforge.models.llama import Llama, config_param_count, param_count
from cpuforge.models.prune import Keep, choose_keep, keep_all, prune
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.data import open_shards, token_byte_lengths, val_batches
from cpuforge.tasks.engine.trainer import train
from cpuforge.tasks.engine.validation import evaluate
from cpuforge.tasks.infra.store import StageRecord
from cpuforge.tasks.records.errors import ConfigError, UserError
from cpuforge.tasks.stages.prune import calibration_batches, target_config
from tests.conftest import build_stage
from tests.test_pretrain import shards, spec_for  # noqa: F401 (fixture)

CFG = LlamaConfig(vocab_size=101, n_layer=4, n_head=6, n_kv_head=2, d_model=48, d_mlp=128, block_size=32)


def test_pruning_nothing_gives_identical_logits():
    torch.manual_seed(0)
    model = Llama(CFG).eval()
    x = torch.randint(0, 101, (2, 20))
    assert torch.equal(prune(model, keep_all(CFG)).eval()(x)[0], model(x)[0])


def test_surgery_gives_a_smaller_valid_model_that_reloads(tmp_path):
    torch.manual_seed(0)
    model = Llama(CFG)
    keep = Keep(layers=[0, 3], kv_heads={0: [1], 3: [0]}, q_per_group={0: [[0, 2]], 3: [[1, 2]]},
                mlp={0: list(range(64)), 3: list(range(64, 128))}, embed=list(range(0, 48, 2)))
    small = prune(model, keep)
    assert small.cfg == replace(CFG, n_layer=2, n_head=2, n_kv_head=1, d_model=24, d_mlp=64, head_dim_override=8)
    assert param_count(small) == config_param_count(small.cfg) < param_count(model) / 3
    save_model(small, tmp_path / "m")
    x = torch.randint(0, 101, (1, 10))
    assert torch.equal(load_model(tmp_path / "m").eval()(x)[0], small.eval()(x)[0])


def test_non_uniform_keeps_are_refused():
    keep = keep_all(CFG)
    keep.mlp[2] = keep.mlp[2][:10]
    with pytest.raises(ValueError, match="layer 2 keeps a different number"):
        prune(Llama(CFG), keep)


@pytest.mark.parametrize("strategy", ["width", "depth", "width_then_depth"])
def test_keep_ratio_halves_the_parameters(strategy):
    cfg = replace(CFG, vocab_size=64)  # 6 heads in 48: only a grid of 8 (lcm 24) lets d_model shrink
    target = target_config(cfg, load_config("tiny", overrides=[f"prune.strategy={strategy}", "prune.width_multiple=8"]).prune)
    ratio = config_param_count(target) / config_param_count(cfg)
    one_layer = (config_param_count(cfg) - config_param_count(replace(cfg, n_layer=cfg.n_layer - 1))) / config_param_count(cfg)
    assert 0.5 - (one_layer if strategy == "depth" else 0.15) < ratio <= 0.5  # depth moves in whole layers
    assert target.n_head % target.n_kv_head == 0 and target.head_dim == cfg.head_dim
    if strategy == "width":
        assert target.n_layer == cfg.n_layer and target.d_model < cfg.d_model
    if strategy == "depth":
        assert target.n_layer < cfg.n_layer and target.d_model == cfg.d_model


def test_pruned_widths_stay_on_their_grid_and_near_the_budget():
    """A 1.26M model (what model.size=auto picks for the demo here) halved: the MLP takes what the grid leaves
    of the budget; on a grid of 32 every row is in whole blocks of llama.cpp's Q8_0."""
    from cpuforge.models.config import ladder_shape

    cfg = LlamaConfig(vocab_size=4096, **ladder_shape(128, 4))
    for multiple in (8, 32):
        for strategy in ("width", "width_then_depth"):
            target = target_config(cfg, load_config("demo", overrides=[
                f"prune.strategy={strategy}", f"prune.width_multiple={multiple}"]).prune)
            assert target.d_model % multiple == 0 and target.d_mlp % multiple == 0 and target.d_mlp <= cfg.d_mlp
            # the grid of 32 is coarse at this width: 3 layers of 64/352 (all the MLP) hold 43%
            assert (0.49 if multiple == 8 else 0.42) < config_param_count(target) / config_param_count(cfg) <= 0.5
    finer = target_config(cfg, load_config("demo", overrides=["prune.strategy=width", "prune.width_multiple=8"]).prune)
    # d_model at the grid points either side of the common factor's width, 72 and 80, each with the MLP the budget
    # leaves, 256 and 184: both hold ~50%, and 80/184 cuts the two widths more alike
    assert (finer.d_model, finer.d_mlp) == (80, 184)


def test_a_coarse_grid_keeps_the_budget():
    """SmolLM2-135M's shape (9 heads: d_model moves in steps of lcm(32, 9) = 288) kept at 70%: the common factor
    alone rounds d_model down to 288 and keeps 48%; the wider grid point with a narrower MLP keeps 69%."""
    cfg = LlamaConfig(vocab_size=49152, n_layer=30, n_head=9, n_kv_head=3, d_model=576, d_mlp=1536, block_size=256)
    target = target_config(cfg, load_config("hour").prune)
    assert (target.d_model, target.d_mlp) == (576, 736)
    assert 0.95 * 0.7 < config_param_count(target) / config_param_count(cfg) <= 0.7


def test_pruned_shapes_are_llamas_that_transformers_accepts():
    """What model.size=auto picks for 5 minutes on a quiet 2-core machine (4 x 192, 3 heads of 64) halved to a
    width of 112 once: transformers refused it (3 heads do not divide 112), and so did GenAI's model builder."""
    from transformers import LlamaConfig as HFLlamaConfig

    from cpuforge.models.config import ladder_shape
    from cpuforge.models.hf_format import hf_config

    cfg = LlamaConfig(vocab_size=4096, **ladder_shape(192, 4))
    for multiple in (8, 32):
        for strategy in ("width", "width_then_depth"):
            target = target_config(cfg, load_config("demo", overrides=[
                f"prune.strategy={strategy}", f"prune.width_multiple={multiple}"]).prune)
            assert target.d_model % target.n_head == 0 and target.d_model % multiple == 0
            assert HFLlamaConfig(**hf_config(target)).hidden_size == target.d_model
    with pytest.raises(ConfigError, match="d_model=100 is not a multiple of n_head=3"):
        target_config(cfg, load_config("demo", overrides=["prune.d_model=100"]).prune)


@pytest.mark.parametrize("overrides, message", [
    (["prune.n_head=5"], "n_kv_head=2 does not divide n_head=5"),
    (["prune.n_head=8", "prune.n_kv_head=1"], "needs 8 query heads per KV head; the model has 3"),
    (["prune.d_mlp=4096"], "d_mlp=4096 is more than the model's 128"),
    (["prune.keep_ratio=0.01"], "no width fits"),
    (["prune.keep_ratio=0.2", "prune.strategy=depth"], "dropping layers cannot reach keep_ratio=0.2"),
])
def test_impossible_targets_are_rejected_clearly(overrides, message):
    with pytest.raises(ConfigError, match=message):
        target_config(CFG, load_config("tiny", overrides=overrides).prune)


def test_importance_beats_random_pruning_on_val_loss(shards, tmp_path):  # noqa: F811
    cfg = load_config("tiny", overrides=["train.max_minutes=null", "train.max_steps=80"])
    s = open_shards(shards, 64)
    torch.manual_seed(0)
    model = Llama(cfg.model.shape(s.vocab_size))
    lengths = token_byte_lengths(s.tokenizer_path)
    val = val_batches(s.val, 4, 8, 64)
    train(model, s.train, val, lengths, cfg.train, tmp_path / "checkpoints")
    target = replace(model.cfg, d_mlp=88, d_model=48, head_dim_override=model.cfg.head_dim)
    imp = activation_importance(model, calibration_batches(s.train, cfg.prune, 64))
    smart_loss, _ = evaluate(prune(model, choose_keep(model.cfg, imp, target)), val, lengths)
    random_losses = []
    for seed in range(3):
        rng = random.Random(seed)
        keep = keep_all(model.cfg)
        keep.mlp = {i: sorted(rng.sample(range(176), 88)) for i in keep.layers}
        keep.embed = sorted(rng.sample(range(64), 48))
        random_losses.append(evaluate(prune(model, keep), val, lengths)[0])
    assert smart_loss < min(random_losses)


def test_prune_reports_its_progress_batch_by_batch(tmp_path, shards):  # noqa: F811
    from cpuforge.tasks.stages.prune import prune_stage

    s = open_shards(shards, CFG.block_size)
    save_model(Llama(replace(CFG, vocab_size=s.vocab_size)), tmp_path / "teacher" / "model")
    teacher = StageRecord(stage="pretrain", key="p", output_dir=str(tmp_path / "teacher"),
                          files={"model": "model", "tokenizer": str(shards / "tokenizer.json")})
    tok = StageRecord(stage="tokenize", key="t", output_dir=str(shards), files={"tokenizer": "tokenizer.json"})
    reports = []
    p = load_config("tiny", overrides=["prune.width_multiple=8"]).prune  # CFG's 6 heads in 48 are off the 32 grid
    prune_stage(p, tok, teacher, tmp_path / "out", report=lambda fraction, headline=None: reports.append(
        (fraction, headline["phase"])))
    fractions = [f for f, _ in reports]
    assert len(reports) == 2 * p.val_batches + p.calib_batches and fractions == sorted(fractions) and fractions[-1] == 1
    assert [phase for i, (_, phase) in enumerate(reports) if i == 0 or reports[i - 1][1] != phase] == [
        "scoring the model", "importance", "scoring the pruned model"]


def test_teacher_and_student_with_different_vocabularies_are_refused(tmp_path, shards):  # noqa: F811
    records = {}
    for name, vocab in (("teacher", 300), ("student", 200)):
        save_model(Llama(replace(CFG, vocab_size=vocab)), tmp_path / name / "model")
        records[name] = StageRecord(stage=name, key=name, output_dir=str(tmp_path / name), files={"model": "model"})
    tok = StageRecord(stage="tokenize", key="t", output_dir=str(shards))
    with pytest.raises(UserError, match="vocabularies differ \\(300 vs 200\\)"):
        build_stage("recover", load_config("tiny"), tmp_path / "out", tokenize=tok, pretrain=records["teacher"],
                    prune=records["student"])


def test_distillation_runs_under_torchrun_with_two_processes(shards, tmp_path):  # noqa: F811
    """Recovery uses the same engine as pretraining, DDP included: student learns from the teacher."""
    import json

    from cpuforge.tasks.engine.training_run import TrainingSpec, launch_torchrun

    s = open_shards(shards, 64)
    cfg = load_config("tiny", overrides=["recover.max_minutes=null", "recover.max_steps=8", "train.eval_interval=4",
                                         "train.checkpoint_every_steps=4", "train.nproc_per_node=2", "train.threads=1"])
    torch.manual_seed(0)
    teacher = Llama(cfg.model.shape(s.vocab_size))
    save_model(teacher, tmp_path / "teacher")
    save_model(prune(teacher, choose_keep(teacher.cfg, activation_importance(teacher, calibration_batches(s.train, cfg.prune, 64)),
                                          replace(teacher.cfg, d_mlp=88, head_dim_override=teacher.cfg.head_dim))),
               tmp_path / "student")
    out = tmp_path / "out"
    out.mkdir()
    spec = TrainingSpec(kind="recover", train=cfg.train, recover=cfg.recover, tokenize_dir=str(shards), out_dir=str(out),
                        student_dir=str(tmp_path / "student"), teacher_dir=str(tmp_path / "teacher"), threads=1,
                        peak_flops=1e12)
    (out / "launch.json").write_text(spec.model_dump_json())
    launch_torchrun(cfg.train, out / "launch.json", "recover-test")
    result = json.loads((out / "result.json").read_text())
    assert result["steps"] == 8 and result["tokens"] == 8 * 8 * 64 * 2
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert {"kd_loss", "lm_loss"} <= set(history[0])
    assert load_model(out / "model").cfg.d_mlp == 88
