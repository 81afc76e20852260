"""train.compile=auto: a bounded, measured probe decides, its graphs serve the training, and the budget pays."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess

import pytest
import torch

from cpuforge.models.config import LlamaConfig
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine import compile_choice, training_run
from cpuforge.tasks.engine.compile_choice import COMPILE_MIN_GAIN, budget_seconds, choose_compile, inductor_cache_dir
from tests.test_pretrain import shards, spec_for  # noqa: F401  (shards is a fixture)

SMALL = LlamaConfig(vocab_size=64, n_layer=1, n_head=2, n_kv_head=1, d_model=16, d_mlp=32, block_size=16)


def test_the_budget_is_known_from_the_clock_or_from_steps_at_a_measured_rate():
    assert budget_seconds(5.0, None, None, 2048, None) == 300
    assert budget_seconds(5.0, 30, None, 2048, None) is None  # 30 steps might take a second
    assert budget_seconds(5.0, 30, None, 2048, 2048.0) == 30
    assert budget_seconds(None, None, 4096, 2048, 1024.0) == 4
    assert budget_seconds(1.0, 1000, None, 2048, 2048.0) == 60


def test_auto_stays_eager_without_probing_where_a_compile_cannot_pay(shards, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(subprocess, "Popen", None)  # nothing here may start a probe
    short = choose_compile("auto", SMALL, 2, 1, "float32", tmp_path, budget_s=60.0)
    assert not short["compile"] and "cannot repay" in short["reason"] and short["probe_s"] == 0
    unknown = choose_compile("auto", SMALL, 2, 1, "float32", tmp_path, budget_s=None)
    assert not unknown["compile"] and "not known" in unknown["reason"]
    several = choose_compile("auto", SMALL, 2, 1, "float32", tmp_path, budget_s=3600.0, world=2)
    assert not several["compile"] and "torchrun" in several["reason"]
    assert choose_compile(True, SMALL, 2, 1, "float32", tmp_path, budget_s=None)["compile"] is True
    assert not (tmp_path / compile_choice.CACHE_FILE).exists()
    # The tiny profile as a run decides: its 30 steps at the measured rate are seconds.
    tiny = load_config("tiny")
    assert tiny.train.compile == load_config("demo").train.compile == "auto"
    spec = training_run.training_spec("pretrain", tiny.train, shards, tmp_path / "out", "", tmp_path / "cache",
                                      model=tiny.model.shape(512))
    decision = training_run.decide_compile(spec).compile
    assert not decision["compile"] and "cannot repay" in decision["reason"]


def test_a_probe_out_of_time_is_stopped_and_remembered(tmp_path, monkeypatch):
    started = []
    real_popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    monkeypatch.setattr(compile_choice, "MIN_PROBE_S", 0.0)
    decision = choose_compile("auto", SMALL, 2, 1, "float32", tmp_path, budget_s=10.0)  # 2 s: less than any compile
    assert not decision["compile"] and "did not finish within 2 s" in decision["reason"]
    assert decision["timed_out_s"] == 2.0 and 2.0 <= decision["probe_s"] < 15
    (proc,) = started
    assert proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nothing of its process group is left
    assert choose_compile("auto", SMALL, 2, 1, "float32", tmp_path, budget_s=10.0)["probe_s"] == 0  # remembered
    assert len(started) == 1
    # With clearly more time to spend, it is tried again.
    monkeypatch.setattr(compile_choice, "_probe", lambda *a: ({"compile": True, "reason": "measured"}, True))
    assert choose_compile("auto", SMALL, 2, 1, "float32", tmp_path, budget_s=20.0)["compile"]


def test_an_interrupted_probe_stops_its_child_and_decides_nothing(tmp_path, monkeypatch):
    started = []

    class InterruptedWhileWaiting(subprocess.Popen):  # Ctrl-C, or a cancelled stage, while the child compiles
        def communicate(self, input=None, timeout=None):
            if timeout is not None and timeout >= compile_choice.MIN_PROBE_S:
                started.append(self)
                raise KeyboardInterrupt
            return super().communicate(input, timeout)

    monkeypatch.setattr(subprocess, "Popen", InterruptedWhileWaiting)
    with pytest.raises(KeyboardInterrupt):
        choose_compile("auto", SMALL, 2, 1, "float32", tmp_path, budget_s=3600.0)
    (proc,) = started
    assert proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
    assert not (tmp_path / compile_choice.CACHE_FILE).exists()


def test_a_machine_that_cannot_compile_trains_eager_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))  # inductor needs a C++ compiler, slim images lack one
    decision = choose_compile("auto", SMALL, 2, 1, "float32", tmp_path, budget_s=3600.0)
    assert "InvalidCxxCompiler" in decision["reason"] and "stayed eager" in decision["reason"]
    assert not decision["compile"] and "torch.compile failed on this machine" in decision["reason"]
    assert len(json.loads((tmp_path / compile_choice.CACHE_FILE).read_text())) == 1  # remembered: it will not change
    # A crash that is not the compiler's (here: the child cannot even start) is not remembered.
    monkeypatch.setattr(compile_choice, "__name__", "cpuforge.no_such_module")
    crashed = choose_compile("auto", SMALL, 4, 1, "float32", tmp_path, budget_s=3600.0)
    assert not crashed["compile"] and "No module named" in crashed["reason"]
    assert len(json.loads((tmp_path / compile_choice.CACHE_FILE).read_text())) == 1


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="torch.compile needs a C++ compiler")
def test_the_probe_measures_the_real_step_and_the_training_compiles_from_its_graphs(
        shards, tmp_path, monkeypatch):  # noqa: F811
    from torch._dynamo.utils import counters

    cache = tmp_path / "cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))  # as inductor sets it once used
    spec = spec_for(shards, tmp_path / "run", "train.max_steps=2", "train.eval_interval=1")
    t = spec.train
    decision = choose_compile("auto", spec.model, t.batch_size, spec.threads, spec.dtype, cache, budget_s=3600.0,
                              optimizer=t.optimizer_in_use())
    assert "measured training step" in decision["reason"]
    assert decision["eager_tok_s"] > 0 and decision["compiled_tok_s"] > 0
    assert 0 < decision["compile_s"] <= decision["probe_s"]
    assert decision["compile"] == (decision["compiled_tok_s"] >= COMPILE_MIN_GAIN * decision["eager_tok_s"])
    cached = json.loads((cache / compile_choice.CACHE_FILE).read_text())
    assert [entry["compile"] for entry in cached.values()] == [decision["compile"]]

    # The training step comes out of the probe's graphs (no cold compile inside the budget), evaluation runs eager.
    counters.clear()
    torch._dynamo.reset()
    result = training_run.run_training(spec.model_copy(update={"compile": {**decision, "compile": True},
                                                               "cache_dir": str(cache)}))
    assert result.steps == 2 and result.compile["compile"] and not math.isnan(result.val_bpb)
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1 and counters["inductor"]["fxgraph_cache_miss"] == 0
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(inductor_cache_dir(cache))
    assert not (tmp_path / "elsewhere").exists()


def test_the_probes_seconds_come_out_of_the_wall_clock_budget(shards, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(compile_choice, "_probe", lambda *a: ({"compile": False, "reason": "measured"}, True))
    cfg = load_config("tiny", overrides=["train.max_steps=null", "train.max_minutes=5", "train.precision=fp32"])
    spec = training_run.decide_compile(training_run.training_spec(
        "pretrain", cfg.train, shards, tmp_path / "out", "", tmp_path / "cache", model=cfg.model.shape(512)))
    assert training_run.compile_params(spec.compile) == {"compiled": False, "compile_choice": "measured"}
    spent = spec.model_copy(update={"compile": {**spec.compile, "probe_s": 30.0}})
    assert training_run._build(spent)[2].max_minutes == pytest.approx(4.5)
    assert training_run.compile_metrics(spent.compile) == {"compile_probe_s": 30.0}
    # Recovery pays its own probe out of its own budget.
    from cpuforge.models.checkpoint import save_model
    from cpuforge.models.llama import Llama

    for name in ("student", "teacher"):
        save_model(Llama(cfg.model.shape(512)), tmp_path / name)
    recover = spent.model_copy(update={"kind": "recover", "model": None, "recover": cfg.recover.model_copy(
        update={"max_steps": None, "max_minutes": 3.0}), "student_dir": str(tmp_path / "student"),
        "teacher_dir": str(tmp_path / "teacher")})
    assert training_run._build(recover)[2].max_minutes == pytest.approx(2.5)
