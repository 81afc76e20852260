"""`model.size: auto`: the shape is chosen from the measured training speed and the budget (the speed is
injected here, so no assertion depends on how fast this machine is), set fields are kept, the
measurement is cached so `cpuforge plan` and the run key the same shape, and the choice is logged."""

from __future__ import annotations

import json
import math

import pytest

from cpuforge.flows.plan import plan
from cpuforge.models.config import AUTO_LADDER, LlamaConfig, ladder_shape
from cpuforge.models.llama import config_param_count, flops_per_token
from cpuforge.tasks.config.explain import explain
from cpuforge.tasks.config.resolve import ResolvedRun
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine import sizing
from cpuforge.tasks.records.errors import ConfigError


@pytest.fixture
def machine(monkeypatch):
    """A machine that trains at `flop_rate` FLOP/s whatever the shape; counts the measurements."""
    state = {"flop_rate": 2e10, "calls": 0, "optimizers": []}

    def fake(shapes, batch, threads, dtype=None, rounds=3, max_step_s=None, optimizer="adamw",
             activation_checkpointing=False):
        state["calls"] += 1
        state["optimizers"].append(optimizer + (" recomputing" if activation_checkpointing else ""))
        return [state["flop_rate"] / flops_per_token(s) for s in shapes]

    monkeypatch.setattr(sizing, "measure_shapes", fake)
    return state


def chosen(tmp_path, machine, *overrides: str) -> LlamaConfig:
    cfg, choice = sizing.resolve_auto_size(load_config("demo", overrides=list(overrides)), tmp_path)
    assert choice is not None and not cfg.model.unresolved
    return cfg.model.shape(4096)


def test_the_demo_and_full_profiles_choose_their_size_and_tiny_stays_fixed():
    for profile in ("demo", "full"):
        cfg = load_config(profile)
        assert cfg.model.size == "auto" and cfg.model.unresolved
        with pytest.raises(ConfigError, match="auto"):
            cfg.model.shape(4096)
    assert load_config("full").model.block_size == 512
    tiny = load_config("tiny")
    assert tiny.model.size == "tiny" and not tiny.model.unresolved


def test_a_bigger_budget_or_a_faster_machine_gets_a_bigger_model(tmp_path, machine):
    short = config_param_count(chosen(tmp_path / "a", machine, "train.max_minutes=5"))
    long = config_param_count(chosen(tmp_path / "b", machine, "train.max_minutes=300"))
    assert long > short
    tokens = config_param_count(chosen(tmp_path / "c", machine, "train.max_minutes=null", "train.max_tokens=200000000"))
    assert tokens > long
    machine["flop_rate"] *= 30  # same budget, a machine 30x faster: more tokens, so more parameters for them
    assert config_param_count(chosen(tmp_path / "d", machine, "train.max_minutes=5")) > short


def test_the_shapes_are_timed_as_the_run_will_step(tmp_path, machine):
    """Muon steps cost more than AdamW's: sizing with AdamW's speed would buy a Muon run too big a model."""
    chosen(tmp_path, machine, "train.max_minutes=5")
    assert machine["optimizers"] == ["muon"]  # optimizer=auto: Muon in one process
    chosen(tmp_path, machine, "train.max_minutes=5", "train.optimizer=adamw")
    assert machine["optimizers"] == ["muon", "adamw"]  # measured anew, not read from Muon's cache
    chosen(tmp_path, machine, "train.max_minutes=5", "train.optimizer=adamw")
    assert machine["optimizers"] == ["muon", "adamw"]
    chosen(tmp_path, machine, "train.max_minutes=5", "train.activation_checkpointing=true")  # recomputing costs too
    assert machine["optimizers"] == ["muon", "adamw", "muon recomputing"]


def test_the_choice_lands_near_the_target_tokens_per_parameter(tmp_path, machine):
    cfg, choice = sizing.resolve_auto_size(load_config("demo", overrides=["train.max_minutes=600"]), tmp_path)
    rates = [machine["flop_rate"] / flops_per_token(s) for s in
             sizing.candidate_shapes({"block_size": 256}, {}, 4096)]
    assert choice.expected_tokens == int(600 * 60 * choice.tokens_per_s)
    assert choice.tokens_per_s in rates
    # the neighbours on the ladder are further from the target (by ratio)
    ratios = [int(600 * 60 * r) / config_param_count(s) for r, s in
              zip(rates, sizing.candidate_shapes({"block_size": 256}, {}, 4096))]
    best = min(ratios, key=lambda r: abs(math.log(r / sizing.TOKENS_PER_PARAM)))
    assert choice.tokens_per_param == pytest.approx(best)
    assert f"{choice.tokens_per_param:.1f} tokens/param" in choice.reason


def test_set_fields_are_kept_and_a_named_size_is_not_measured(tmp_path, machine):
    shape = chosen(tmp_path, machine, "train.max_minutes=300", "model.n_layer=3", "model.block_size=128")
    assert shape.n_layer == 3 and shape.block_size == 128
    shape = chosen(tmp_path, machine, "train.max_minutes=300", "model.d_model=192")
    assert shape.d_model == 192 and shape.d_model % shape.n_head == 0
    calls = machine["calls"]
    cfg = load_config("demo", overrides=["model.size=demo"])
    assert sizing.resolve_auto_size(cfg, tmp_path) == (cfg, None) and machine["calls"] == calls
    full = {f"model.{k}={v}" for k, v in ladder_shape(*AUTO_LADDER[2]).items()}
    cfg = load_config("demo", overrides=sorted(full))
    assert not cfg.model.unresolved and sizing.resolve_auto_size(cfg, tmp_path) == (cfg, None)


def test_the_ladder_keeps_widths_quantizable_and_heads_valid():
    for d_model, n_layer in AUTO_LADDER:
        shape = LlamaConfig(vocab_size=4096, **ladder_shape(d_model, n_layer))
        assert shape.d_model % 32 == 0 and shape.d_mlp % 32 == 0 and shape.head_dim == 64
        assert shape.n_head % shape.n_kv_head == 0


def test_plan_and_run_choose_the_same_shape_from_the_cached_measurement(tmp_path, machine):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text\n" * 50)
    cfg = load_config("demo", overrides=[f"data.source={corpus}"])
    planned = {row.stage: row.key for row in plan(ResolvedRun(cfg, tmp_path / "work"))}
    assert machine["calls"] == 1
    cache = json.loads((tmp_path / "work" / "cache" / sizing.CACHE_FILE).read_text())
    assert len(cache) == len(sizing.candidate_shapes({"block_size": 256}, {}, 4096))
    machine["flop_rate"] *= 100  # the machine got faster, but the run reads the cached measurement
    resolved, _ = sizing.resolve_auto_size(cfg, tmp_path / "work")
    assert machine["calls"] == 1
    assert {row.stage: row.key for row in plan(ResolvedRun(resolved, tmp_path / "work"))} == planned


def test_explain_says_auto_fills_only_what_is_not_set():
    text = explain(load_config("demo"))
    assert "'auto'" in text and "auto fills only the fields left empty" in text


def test_shapes_too_slow_to_time_are_extrapolated_from_the_largest_timed_one(tmp_path, monkeypatch):
    shapes = sizing.candidate_shapes({"block_size": 256}, {}, 4096)
    timed = 4
    monkeypatch.setattr(sizing, "measure_shapes", lambda shapes, *a, **k: [
        (1e9 if i < timed - 1 else 3e9) / flops_per_token(s) if i < timed else None for i, s in enumerate(shapes)])
    rates = sizing.throughput(shapes, 8, 2, None, tmp_path)
    for shape, rate in zip(shapes[timed:], rates[timed:]):
        assert rate == pytest.approx(3e9 / flops_per_token(shape))
    assert rates[0] == pytest.approx(1e9 / flops_per_token(shapes[0]))
