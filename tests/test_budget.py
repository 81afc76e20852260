"""budget.minutes (the hour and overnight profiles): one target for the whole job, planned into pretraining's and
recovery's minutes for the model at hand, from the settings and the shape alone (no timing: the machine is
injected where auto-size needs one)."""

from __future__ import annotations

import pytest

from cpuforge.models.llama import config_param_count
from cpuforge.tasks.config.budget import FIXED_S, PER_MPARAM_S, plan_budget
from cpuforge.tasks.config.resolve import ResolvedRun
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.records.errors import ConfigError
from cpuforge.tasks.stages.prune import target_config
from tests.test_config_size import machine  # noqa: F401  (fixture)

SMOL_135M = ["model.n_layer=30", "model.d_model=576", "model.n_head=9", "model.n_kv_head=3", "model.d_mlp=1536",
             "tokenizer.vocab_size=49152"]
TINYLLAMA_1B = ["model.n_layer=22", "model.d_model=2048", "model.n_head=32", "model.n_kv_head=4",
                "model.d_mlp=5632", "model.tie_embeddings=false", "tokenizer.vocab_size=32000"]


def test_compress_spends_what_the_other_stages_leave_on_recovery():
    cfg = load_config("hour", overrides=SMOL_135M)
    planned, plan = plan_budget(cfg, compress=True)
    shape = cfg.model.shape(49152)
    params, pruned = config_param_count(shape), config_param_count(target_config(shape, cfg.prune))
    assert plan.params == params and plan.pruned_params == pruned and 130e6 < params < 140e6
    other = (FIXED_S + PER_MPARAM_S * (params + pruned) / 1e6) / 60
    assert planned.recover.max_minutes == pytest.approx(60 - other, abs=0.1)
    assert plan.pretrain_minutes is None and planned.train == cfg.train  # nothing pretrains in compress
    assert "recover" in plan.describe() and "134" in plan.describe()
    # the timing rounds of quantize and evaluate get 5% of the hour each, and quantize's candidates as long to
    # build (the stage near 10% of the budget), unless set by hand
    assert planned.eval.speed_seconds == planned.quantize.speed_seconds == planned.quantize.build_seconds == 180
    assert "180 s" in plan.describe()
    pinned, _ = plan_budget(load_config("hour", overrides=[*SMOL_135M, "eval.speed_seconds=30",
                                                           "quantize.build_seconds=600"]), compress=True)
    assert pinned.eval.speed_seconds == 30 and pinned.quantize.speed_seconds == 180
    assert pinned.quantize.build_seconds == 600

    # a bigger model: the other stages take longer, recovery has less of the same three hours
    small, _ = plan_budget(load_config("hour", overrides=[*SMOL_135M, "budget.minutes=180"]), compress=True)
    big, _ = plan_budget(load_config("hour", overrides=[*TINYLLAMA_1B, "budget.minutes=180"]), compress=True)
    assert big.recover.max_minutes < small.recover.max_minutes
    # overnight: the night, less the same other stages, recovers
    night, _ = plan_budget(load_config("overnight", overrides=SMOL_135M), compress=True)
    assert night.recover.max_minutes == pytest.approx(480 - other, abs=0.1)


def test_run_sizes_the_model_for_pretrainings_share_then_plans_for_it(tmp_path, machine):  # noqa: F811
    run = ResolvedRun(load_config("hour"), tmp_path)
    run.start(None)
    cfg = run.cfg
    assert not cfg.model.unresolved  # auto chose a shape for pretraining's minutes
    shape = cfg.model.shape(cfg.tokenizer.vocab_size)
    params, pruned = config_param_count(shape), config_param_count(target_config(shape, cfg.prune))
    other = (FIXED_S + PER_MPARAM_S * (params + pruned) / 1e6) / 60
    assert cfg.train.max_minutes + cfg.recover.max_minutes + other == pytest.approx(60, abs=0.2)
    assert cfg.train.max_minutes == pytest.approx(0.6 * (60 - other), abs=0.1)

    again = ResolvedRun(load_config("hour"), tmp_path)
    again.start(None)  # the same settings, the same plan: the stage keys hold its minutes
    assert (again.cfg.train, again.cfg.recover, again.cfg.model) == (cfg.train, cfg.recover, cfg.model)


def test_without_a_budget_the_stages_keep_their_minutes():
    cfg = load_config("demo", overrides=["model.size=demo"])
    assert plan_budget(cfg, compress=True) == (cfg, None)
    pinned, plan = plan_budget(load_config("hour", overrides=[*SMOL_135M, "budget.minutes=null",
                                                              "recover.max_minutes=7"]), compress=True)
    assert plan is None and pinned.recover.max_minutes == 7 and pinned.eval.speed_seconds is None
    assert pinned.quantize.build_seconds is None  # every candidate is built


def test_a_budget_too_small_for_the_model_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"budget.minutes=10 leaves no time to train.*raise budget.minutes"):
        plan_budget(load_config("hour", overrides=[*TINYLLAMA_1B, "budget.minutes=10"]), compress=True)
    with pytest.raises(ConfigError, match=r"budget.minutes=60 .* for 1100M -> 767M parameters"):
        plan_budget(load_config("hour", overrides=TINYLLAMA_1B), compress=True)  # an hour is too short for 1.1B
    with pytest.raises(ConfigError, match="budget.pretrain_share"):
        load_config("hour", overrides=["budget.pretrain_share=1.5"])
