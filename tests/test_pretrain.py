"""Training on real token shards: learning, exact resume after SIGKILL, torchrun/DDP, bad input."""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from cpuforge.models.checkpoint import save_training_checkpoint
from cpuforge.models.config import LlamaConfig
from cpuforge.models.llama import Llama
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.allocator import keep_freed_memory
from cpuforge.tasks.engine.data import open_shards, token_byte_lengths, unigram_bpb
from cpuforge.tasks.engine.hardware import peak_rss_mb
from cpuforge.tasks.engine.trainer import lr_at
from cpuforge.tasks.engine.training_run import TrainingSpec, launch_torchrun, run_training
from cpuforge.tasks.records.errors import DataError, UserError
from cpuforge.tasks.stages.pretrain import _check_resumable
from cpuforge.tasks.stages.tokenize import tokenize
from tests.conftest import make_text

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shards")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"{i}.txt").write_text(make_text(i, 80))
    out = root / "tok"
    out.mkdir()
    cfg = load_config("tiny", overrides=[f"data.source={corpus}", "data.max_docs=null"])
    tokenize(cfg.data, cfg.tokenizer, out, root / "cache")
    return out


def spec_for(shards: Path, out_dir: Path, *overrides: str, threads: int = 1) -> TrainingSpec:
    cfg = load_config("tiny", overrides=["train.max_minutes=null", *overrides])
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = open_shards(shards, cfg.model.block_size).vocab_size
    return TrainingSpec(kind="pretrain", train=cfg.train, recover=cfg.recover, model=cfg.model.shape(vocab),
                        tokenize_dir=str(shards), out_dir=str(out_dir), threads=threads, peak_flops=1e12)


def test_training_learns_and_reports(shards, tmp_path):
    result = run_training(spec_for(shards, tmp_path / "run", "train.max_steps=40")).model_dump()
    assert result["steps"] == 40 and result["tokens"] == 40 * 8 * 64
    history = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert history[0]["loss"] > history[-1]["loss"] + 0.5
    assert history[-1]["loss"] < math.log(open_shards(shards, 64).vocab_size)
    s = open_shards(shards, 64)
    lengths = token_byte_lengths(s.tokenizer_path)
    uniform_bpb = math.log2(s.vocab_size) * len(s.val) / lengths[s.val].sum()
    assert result["val_bpb"] < uniform_bpb
    assert unigram_bpb(s.train, s.val, s.vocab_size, lengths) < uniform_bpb
    assert result["tokens_per_s"] > 0 and 0 < result["mfu"] < 1 and result["peak_rss_mb"] > 50
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "model" / "tokenizer.json").is_file()


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="the peak RSS cannot be reset here")
def test_a_trainings_peak_memory_is_its_own_not_the_process_s(shards, tmp_path):
    # In a run, model.size=auto times bigger shapes in the same process before training starts.
    def rss_mb() -> float:
        status = Path("/proc/self/status").read_text()
        return next(int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS:"))

    keep_freed_memory()  # as the step timers set it: freed blocks under 32 MB stay with the process
    before = rss_mb()
    spike = [np.ones(1 << 20) for _ in range(190)]  # 1.5 GB in 8 MB blocks, written, then freed but the last
    del spike[:-1]
    assert peak_rss_mb() > before + 1000 and rss_mb() > before + 1000  # held, as sizing's shapes were
    result = run_training(spec_for(shards, tmp_path / "run", "train.max_steps=2"))
    assert result.peak_rss_mb < before + 1000, "the training reported the process's earlier peak as its own"
    assert rss_mb() < before + 1000, "the memory freed before training was held through it"


def _train_in_subprocess(spec: TrainingSpec, spec_path: Path) -> subprocess.Popen:
    spec_path.write_text(spec.model_dump_json())
    code = "import json, sys; from cpuforge.tasks.engine.training_run import run_training; run_training(json.load(open(sys.argv[1])))"
    return subprocess.Popen([sys.executable, "-c", code, str(spec_path)], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_sigkill_then_rerun_ends_with_bitwise_identical_weights(shards, tmp_path):
    args = ("train.max_steps=150", "train.checkpoint_every_steps=10", "train.eval_interval=50")
    straight = _train_in_subprocess(spec_for(shards, tmp_path / "a", *args), tmp_path / "a.json")
    assert straight.wait(timeout=300) == 0

    killed = _train_in_subprocess(spec_for(shards, tmp_path / "b", *args), tmp_path / "b.json")
    marker = tmp_path / "b" / "checkpoints" / "step-00000030"
    deadline = time.time() + 120
    while not marker.exists() and time.time() < deadline and killed.poll() is None:
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert killed.returncode == -signal.SIGKILL, "training finished before it could be killed"
    assert not (tmp_path / "b" / "result.json").exists()

    rerun = _train_in_subprocess(spec_for(shards, tmp_path / "b", *args), tmp_path / "b.json")
    assert rerun.wait(timeout=300) == 0
    result = json.loads((tmp_path / "b" / "result.json").read_text())
    assert result["resumed_from"] >= 30 and result["steps"] == 150
    a = load_file(str(tmp_path / "a" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bitwise, not approximately


def test_recovery_trains_under_the_train_section_with_its_own_overrides():
    from cpuforge.tasks.engine.training_run import budget_left, recover_train_config

    cfg = load_config("tiny", overrides=["train.warmup_steps=30", "train.lr_schedule=wsd", "train.optimizer=muon",
                                         "recover.lr=4e-4", "recover.optimizer=adamw", "recover.muon_lr=3e-3",
                                         "recover.max_steps=7", "recover.max_minutes=null"])
    t, r = cfg.train, cfg.recover
    recover = recover_train_config(t, r)
    assert type(recover) is type(t)  # one settings type: the train section, never a copy of its fields
    overridden = {"lr": 4e-4, "min_lr": 4e-4 / 10, "optimizer": "adamw", "muon_lr": 3e-3, "lr_schedule": "cosine",
                  "warmup_steps": 10, "max_tokens": r.max_tokens, "max_steps": 7, "max_minutes": None,
                  "seed": t.seed + 1}
    assert {k: getattr(recover, k) for k in overridden} == overridden
    assert recover.model_dump(exclude=set(overridden)) == t.model_dump(exclude=set(overridden))
    assert recover_train_config(t.model_copy(update={"warmup_steps": 4}), r).warmup_steps == 4
    assert t.lr_schedule == "wsd" and t.seed == 1337  # the stage's own section is left as it was
    assert budget_left(t.model_copy(update={"max_minutes": 2.0}), 30).max_minutes == 1.5
    assert budget_left(t, 0) is t


def test_result_json_keeps_its_keys_and_older_files_load(shards, tmp_path):
    from cpuforge.tasks.engine.training_run import TrainingResult

    run_training(spec_for(shards, tmp_path / "run", "train.max_steps=2"))
    written = json.loads((tmp_path / "run" / "result.json").read_text())
    assert list(written) == ["steps", "tokens", "seconds", "tokens_per_s", "mfu", "val_loss", "val_bpb",
                             "peak_rss_mb", "resumed_from", "compile"]  # the history is history.jsonl's
    older = {k: v for k, v in written.items() if k not in ("compile", "resumed_from")}
    assert TrainingResult.model_validate_json(json.dumps(older)).compile == {}
    history = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2] and isinstance(history[0]["step"], int)


def test_wsd_schedule_warms_up_holds_the_peak_then_decays_linearly_to_min_lr():
    s = load_config("tiny").train.model_copy(update={"lr": 1.0, "min_lr": 0.1, "warmup_steps": 10,
                                                     "lr_schedule": "wsd", "cooldown_fraction": 0.4})
    lrs = [lr_at(step, s, horizon=100) for step in range(100)]
    assert lrs[0] == 0.1 and lrs[9] == 1.0
    assert all(lr == 1.0 for lr in lrs[10:60])
    decay = lrs[60:]
    assert all(a > b for a, b in zip(decay, decay[1:])) and decay[-1] == pytest.approx(0.1)
    assert decay[0] - decay[1] == pytest.approx(decay[-2] - decay[-1])  # linear


def test_muon_recipe_trains_and_resumes_to_the_same_weights(shards, tmp_path):
    """optimizer=muon with the WSD schedule and zero-initialised projections: it learns, and a run
    restarted from its step-10 checkpoint (Muon's momentum included) ends bitwise equal to a straight one."""
    args = ("train.max_steps=20", "train.checkpoint_every_steps=10", "train.optimizer=muon", "train.muon_lr=0.01",
            "train.lr_schedule=wsd", "train.zero_init_residual=true", "train.warmup_steps=3")
    straight = run_training(spec_for(shards, tmp_path / "a", *args)).model_dump()
    history = [json.loads(line) for line in (tmp_path / "a" / "history.jsonl").read_text().splitlines()]
    assert straight["steps"] == 20 and history[-1]["loss"] < history[0]["loss"] - 0.5
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step-00000010", tmp_path / "b" / "checkpoints" / "step-00000010")
    resumed = run_training(spec_for(shards, tmp_path / "b", *args)).model_dump()
    assert resumed["resumed_from"] == 10 and resumed["steps"] == 20
    a = load_file(str(tmp_path / "a" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_muons_newton_schulz_in_bf16_gives_the_fp32_iterations_matrix():
    """Where the step runs in bf16, Muon orthogonalizes in bf16 (as torch.optim.Muon does): the update
    comes back in the parameter's dtype and close to the fp32 iteration's, singular values near 1."""
    from cpuforge.tasks.engine.muon import orthogonalize

    g = torch.randn(96, 32, generator=torch.Generator().manual_seed(0))
    exact, low = orthogonalize(g), orthogonalize(g, dtype=torch.bfloat16)
    assert low.dtype == torch.float32 and low.shape == g.shape
    assert (low - exact).norm() / exact.norm() < 0.05
    singular = torch.linalg.svdvals(low)
    assert singular.min() > 0.5 and singular.max() < 1.3


def test_a_run_resumes_under_the_optimizer_that_wrote_its_checkpoint(shards, tmp_path, caplog):
    """An AdamW checkpoint (an FSDP run's under optimizer=auto, or one from before Muon) resumed where
    train.optimizer now names Muon continues with AdamW, its state intact, and says so."""
    base = ("train.max_steps=12", "train.checkpoint_every_steps=6")
    run_training(spec_for(shards, tmp_path / "a", *base, "train.optimizer=adamw"))
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step-00000006", tmp_path / "b" / "checkpoints" / "step-00000006")
    with caplog.at_level(logging.WARNING, logger="cpuforge.trainer"):
        resumed = run_training(spec_for(shards, tmp_path / "b", *base, "train.optimizer=muon")).model_dump()
    assert resumed["resumed_from"] == 6 and resumed["steps"] == 12
    assert "written by adamw: resuming with adamw, not muon" in caplog.text
    a = load_file(str(tmp_path / "a" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same training as the uninterrupted AdamW run


def test_two_processes_with_ddp_over_gloo(shards, tmp_path):
    from mlflow import MlflowClient

    from cpuforge.tasks.engine.training_run import TrainingHooks
    from cpuforge.tasks.infra.tracking import MetricLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("ddp")).info.run_id
    spec = spec_for(shards, tmp_path / "ddp", "train.max_steps=12", "train.nproc_per_node=2",
                    "train.eval_interval=6", "train.checkpoint_every_steps=6").model_copy(
        update={"tracking_uri": uri, "run_id": run_id, "hooks": TrainingHooks.of(metrics=MetricLogger)})
    spec_path = tmp_path / "ddp" / "launch.json"
    spec_path.write_text(spec.model_dump_json())
    launch_torchrun(spec.train, spec_path, "k" * 16)
    result = json.loads((tmp_path / "ddp" / "result.json").read_text())
    assert result["steps"] == 12
    assert result["tokens"] == 12 * 8 * 64 * 2  # both ranks' batches count
    history = [json.loads(line) for line in (tmp_path / "ddp" / "history.jsonl").read_text().splitlines()]
    assert history[-1]["loss"] < history[0]["loss"]
    assert sorted(p.name for p in (tmp_path / "ddp" / "checkpoints").iterdir()) == ["step-00000006", "step-00000012"]
    # rank 0's per-step metrics reach the stage's run from the worker, through the spec's hook
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == list(range(1, 13))
    assert [m.step for m in client.get_metric_history(run_id, "val/bpb")] == [6, 12]


def test_fsdp_on_two_processes_and_its_checkpoints_resume_under_any_strategy(shards, tmp_path):
    """FSDP over gloo on loopback; its sharded checkpoint resumes in one process, and a one-process
    (full) checkpoint resumes under FSDP."""
    def launch(out: Path, *overrides: str, processes: int) -> dict:
        spec = spec_for(shards, out, *overrides, f"train.nproc_per_node={processes}", "train.strategy=fsdp",
                        "train.eval_interval=6", "train.checkpoint_every_steps=6")
        if processes == 1:
            return run_training(spec).model_dump()
        (out / "launch.json").write_text(spec.model_dump_json())
        launch_torchrun(spec.train, out / "launch.json", "f" * 16)
        return json.loads((out / "result.json").read_text())

    def resume_from_step_12(source: Path, out: Path, processes: int) -> dict:
        """Continue `source`'s run from its step-12 checkpoint (as if it had stopped there)."""
        shutil.copytree(source / "checkpoints", out / "checkpoints")
        shutil.rmtree(out / "checkpoints" / "step-00000018")
        return launch(out, "train.max_steps=18", processes=processes)

    sharded = launch(tmp_path / "fsdp", "train.max_steps=18", processes=2)
    assert sharded["steps"] == 18 and sharded["tokens"] == 18 * 8 * 64 * 2
    history = [json.loads(line) for line in (tmp_path / "fsdp" / "history.jsonl").read_text().splitlines()]
    assert history[-1]["loss"] < history[0]["loss"] - 0.3
    last = tmp_path / "fsdp" / "checkpoints" / "step-00000018"
    # Sharded: each rank wrote its own part; no full copy of the training state was gathered anywhere.
    assert (last / "shards").is_dir() and not (last / "model.safetensors").exists()
    assert len(list((last / "shards").glob("*.distcp"))) == 2
    final = load_file(str(tmp_path / "fsdp" / "model" / "model.safetensors"))  # the deliverable model is whole
    assert "model.embed_tokens.weight" in final and final["model.embed_tokens.weight"].shape[1] == 64  # transformers names

    alone = resume_from_step_12(tmp_path / "fsdp", tmp_path / "fsdp-then-one", processes=1)
    assert alone["resumed_from"] == 12 and alone["steps"] == 18
    resharded = resume_from_step_12(tmp_path / "fsdp", tmp_path / "fsdp-again", processes=2)  # a retry
    assert resharded["resumed_from"] == 12 and resharded["steps"] == 18

    single = launch(tmp_path / "one", "train.max_steps=18", processes=1)
    assert single["steps"] == 18
    again = resume_from_step_12(tmp_path / "one", tmp_path / "one-then-fsdp", processes=2)
    assert again["resumed_from"] == 12 and again["steps"] == 18
    losses = [json.loads(line)["loss"] for line in (tmp_path / "one-then-fsdp" / "history.jsonl").read_text().splitlines()]
    assert len(losses) == 18 and losses[-1] < losses[0] - 0.3  # the history carried across strategies


class _RunsCode:
    """What an attacker would pickle: unpickling it creates a file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _sharded_checkpoint(root: Path, poisoned_lr: Path | None = None) -> tuple[Path, Llama]:
    """A sharded checkpoint (torch.distributed.checkpoint + manifest) as an FSDP run writes it, from one
    process; with `poisoned_lr`, the optimizer's learning rate is saved as an object that runs code."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from cpuforge.models.checkpoint import checkpoint_tmp_dir, finish_checkpoint
    from cpuforge.tasks.engine.sharding import SHARDS, _create_optimizer_state

    model = Llama(LlamaConfig(vocab_size=64, n_layer=1, n_head=2, n_kv_head=1, d_model=16, d_mlp=32, block_size=8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _create_optimizer_state(model, optimizer)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    if poisoned_lr:
        state["optim"]["param_groups"][0]["lr"] = _RunsCode(poisoned_lr)
    tmp = checkpoint_tmp_dir(root, 1)
    tmp.mkdir(parents=True)
    dcp.save(state, checkpoint_id=str(tmp / SHARDS), no_dist=True)
    return finish_checkpoint(root, 1, tmp, model.cfg, {"step": 1}), model


def test_fsdp_sharded_checkpoint_is_manifest_verified_and_loads_without_unpickling_code(tmp_path):
    from cpuforge.models.checkpoint import CheckpointError, latest_valid_checkpoint, verify_checkpoint
    from cpuforge.tasks.engine.sharding import SHARDS, load_sharded_checkpoint

    def fresh():
        model = Llama(saved.cfg)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    folder, saved = _sharded_checkpoint(tmp_path / "ok")
    model, optimizer = fresh()
    load_sharded_checkpoint(model, optimizer, folder)  # a clean checkpoint loads, param_groups included
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values()))
    assert optimizer.param_groups[0]["lr"] == 1e-3 and optimizer.state

    # A changed byte in a shard or in the index: refused before torch.distributed.checkpoint reads it.
    for name in (".metadata", "__0_0.distcp"):
        tampered = tmp_path / f"tampered{name}"
        shutil.copytree(folder.parent, tampered)
        with open(tampered / folder.name / SHARDS / name, "r+b") as f:
            f.seek(40)
            byte = f.read(1)
            f.seek(40)
            f.write(bytes([byte[0] ^ 1]))
        with pytest.raises(CheckpointError, match=f"{name} is truncated or corrupted"):
            verify_checkpoint(tampered / folder.name)
        assert latest_valid_checkpoint(tampered) is None

    # Someone who can write the folder can rewrite the manifest too; then the load itself refuses code,
    # in the index (.metadata) and in the non-tensor values (the optimizer's param_groups).
    marker = tmp_path / "code-ran"
    evil_index = tmp_path / "evil-index"
    shutil.copytree(folder.parent, evil_index)
    (evil_index / folder.name / SHARDS / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    evil_values, _ = _sharded_checkpoint(tmp_path / "evil-values", poisoned_lr=marker)
    for evil in (evil_index / folder.name, evil_values):
        _rewrite_manifest(evil)
        verify_checkpoint(evil)
        model, optimizer = fresh()
        with pytest.raises(CheckpointError, match="cannot load its shards"):
            load_sharded_checkpoint(model, optimizer, evil)
        assert not marker.exists()


def _rewrite_manifest(folder: Path) -> None:
    from cpuforge.models.fileio import sha256_file

    manifest = json.loads((folder / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        entry.update(bytes=(folder / name).stat().st_size, sha256=sha256_file(folder / name))
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_bad_training_inputs_fail_before_training(shards, tmp_path):
    with pytest.raises(DataError, match="fewer than one sequence of model.block_size=100000"):
        open_shards(shards, 100_000)
    with pytest.raises(DataError, match="meta.json is missing"):
        open_shards(tmp_path, 64)
    other = Llama(LlamaConfig(vocab_size=50, n_layer=1, n_head=2, n_kv_head=1, d_model=16, d_mlp=32, block_size=16))
    save_training_checkpoint(tmp_path / "ck", 5, other, {}, {"step": 5})
    with pytest.raises(UserError, match="checkpoint of another model config"):
        _check_resumable(tmp_path / "ck", LlamaConfig(vocab_size=50, n_layer=2, n_head=2, n_kv_head=1, d_model=16,
                                                      d_mlp=32, block_size=16))


SMALL = LlamaConfig(vocab_size=64, n_layer=1, n_head=2, n_kv_head=1, d_model=16, d_mlp=32, block_size=16)


def test_mfu_divides_by_the_peak_of_the_chosen_precision(shards, tmp_path, monkeypatch):
    import cpuforge.tasks.engine.training_run as training_run

    asked = []

    def fake_peak(threads, cache_dir, dtype=torch.float32):
        asked.append(dtype)
        return {torch.float32: 1e11, torch.bfloat16: 4e11}[dtype]

    monkeypatch.setattr(training_run, "matmul_peak", fake_peak)
    for precision, dtype, peak in (("bf16", torch.bfloat16, 4e11), ("fp32", torch.float32, 1e11)):
        cfg = load_config("tiny", overrides=[f"train.precision={precision}"])
        spec = training_run.training_spec("pretrain", cfg.train, shards, tmp_path / "out", "", tmp_path / "cache",
                                          model=cfg.model.shape(512))
        assert asked[-1] == dtype and spec.dtype == str(dtype).removeprefix("torch.") and spec.peak_flops == peak
        assert training_run.precision_params(spec)["matmul_peak_dtype"] == spec.dtype


def fake_step_timer(per_sequence: dict, timed: list, noise=lambda: 1.0):
    """A training_step_timer stand-in: a step of `rows` sequences takes rows x per_sequence[dtype] seconds
    (times noise()); each timer built is recorded in `timed`."""
    def timer(model_cfg, batch, optimizer="adamw", teacher_cfg=None, activation_checkpointing=False):
        timed.append([])
        return lambda dtype=torch.float32, rows=None: timed[-1].append((dtype, rows)) or \
            (rows or batch) * per_sequence[dtype] * noise()
    return timer


def test_auto_precision_is_a_measured_ab_cached_per_shape(tmp_path, monkeypatch):
    import cpuforge.tasks.engine.hardware as hardware
    import cpuforge.tasks.engine.step_timing as step_timing

    timed = []
    monkeypatch.setattr(step_timing, "training_step_timer",
                        fake_step_timer({torch.float32: 16 / 1000, torch.bfloat16: 16 / 1800}, timed))
    monkeypatch.setattr(hardware, "has_native_bf16", lambda: True)
    chosen = step_timing.choose_precision("auto", SMALL, 4, 2, tmp_path)
    assert chosen["dtype"] == "bfloat16" and chosen["fp32_tok_s"] == 1000.0 and chosen["bf16_tok_s"] == 1800.0
    assert chosen["ab_batch"] == 4 and {rows for _, rows in timed[0]} == {4}  # no budget given: the run's batch
    assert step_timing.choose_precision("auto", SMALL, 4, 2, tmp_path) == chosen and len(timed) == 1  # cached
    step_timing.choose_precision("auto", SMALL, 8, 2, tmp_path)  # another batch is another decision
    assert len(timed) == 2
    step_timing.choose_precision("auto", SMALL, 8, 2, tmp_path, optimizer="muon")  # and another optimizer
    assert len(timed) == 3

    monkeypatch.setattr(step_timing, "training_step_timer",
                        fake_step_timer({torch.float32: 16 / 1000, torch.bfloat16: 16 / 1020}, timed))
    assert step_timing.choose_precision("auto", SMALL, 16, 2, tmp_path)["dtype"] == "float32"  # a draw is fp32's

    monkeypatch.setattr(hardware, "has_native_bf16", lambda: False)
    emulated = step_timing.choose_precision("auto", SMALL, 32, 2, tmp_path)
    assert emulated["dtype"] == "float32" and emulated["bf16_tok_s"] is None
    assert {dtype for dtype, _ in timed[-1]} == {torch.float32}
    assert "no native bf16" in emulated["reason"]


def test_the_precision_ab_spends_at_most_its_share_of_the_budget(tmp_path, monkeypatch):
    import cpuforge.tasks.engine.hardware as hardware
    import cpuforge.tasks.engine.step_timing as step_timing

    monkeypatch.setattr(hardware, "has_native_bf16", lambda: True)
    monkeypatch.setattr(hardware, "matmul_peak", lambda threads, cache_dir, dtype=None: 2e12)
    timed = []
    per_sequence = {torch.float32: 10.0, torch.bfloat16: 4.0}  # seconds a step spends per sequence
    monkeypatch.setattr(step_timing, "training_step_timer", fake_step_timer(per_sequence, timed))

    # a big model's step in a long budget: one sequence each tells the cost, the A/B times what fits in 5%
    hour = step_timing.choose_precision("auto", SMALL, 8, 2, tmp_path, budget_s=3600)
    cost = sum(rows * per_sequence[dtype] for dtype, rows in timed[-1])
    assert cost <= step_timing.PROBE_SHARE * 3600 and abs(hour["probe_s"] - cost) < 1
    # 5% of 3600 s is 180 s; one sequence each (a warm-up and a step: 28 s) leaves 152 s, and an A/B of 4 steps
    # per precision costs 56 s per sequence: 2 of the batch's 8 fit, 3 would not
    assert hour["ab_batch"] == 2 and "timed at 2 of the batch's 8 sequences" in hour["reason"]
    assert hour["dtype"] == "bfloat16"
    assert step_timing.choose_precision("auto", SMALL, 8, 2, tmp_path, budget_s=3600) == hour  # kept: settled

    # a short budget: the single steps decide, for this run only
    short = step_timing.choose_precision("auto", SMALL, 16, 2, tmp_path, budget_s=60)
    assert short["dtype"] == "bfloat16" and short["ab_batch"] == 1 and "single steps" in short["reason"]
    assert {rows for _, rows in timed[-1]} == {1} and len(timed[-1]) == 4  # a warm-up and a step of each
    step_timing.choose_precision("auto", SMALL, 16, 2, tmp_path, budget_s=60)
    assert len(timed) == 3  # not cached: measured again

    # a busy machine: rounds far apart are used, said and not kept
    jitter = iter([1.0, 1.0] + [1.0, 1.0, 1.6, 1.6, 1.6, 1.6] * 2)
    monkeypatch.setattr(step_timing, "training_step_timer", fake_step_timer(per_sequence, timed, lambda: next(jitter)))
    busy = step_timing.choose_precision("auto", SMALL, 4, 2, tmp_path)
    assert busy["dtype"] == "bfloat16" and "the machine was busy" in busy["reason"]
    assert step_timing.step_key(SMALL, 4, 2) not in json.loads((tmp_path / "precision.json").read_text())


def test_a_step_too_big_for_the_share_is_not_timed_at_all(tmp_path, monkeypatch):
    import cpuforge.tasks.engine.hardware as hardware
    import cpuforge.tasks.engine.step_timing as step_timing

    # TinyLlama's shape distilled into half of it: one sequence's step alone is ~13 TFLOP with Muon
    teacher = LlamaConfig(vocab_size=32000, n_layer=22, d_model=2048, n_head=32, n_kv_head=4, d_mlp=5632,
                          block_size=256, tie_embeddings=False)
    student = replace(teacher, d_model=1408, d_mlp=3968, n_head=22, n_kv_head=2)
    timed = []
    monkeypatch.setattr(step_timing, "training_step_timer", fake_step_timer({}, timed))
    monkeypatch.setattr(hardware, "matmul_peak", lambda threads, cache_dir, dtype=None: 2e12)
    monkeypatch.setattr(hardware, "has_native_bf16", lambda: True)
    floor = step_timing.single_step_floor_s(student, teacher, "muon", 2, tmp_path, 2)
    assert floor > 10
    chosen = step_timing.choose_precision("auto", student, 8, 2, tmp_path, teacher, "muon", budget_s=120)
    assert timed == [] and chosen["dtype"] == "bfloat16" and chosen["probe_s"] == 0.0  # nothing built or run
    assert "not timed" in chosen["reason"] and "5% of the 120 s budget" in chosen["reason"]
    assert not (tmp_path / "precision.json").exists()  # a longer budget may afford the A/B
    monkeypatch.setattr(hardware, "has_native_bf16", lambda: False)
    assert step_timing.choose_precision("auto", student, 8, 2, tmp_path, teacher, "muon", budget_s=120)["dtype"] == \
        "float32"
    # a night's budget affords it
    monkeypatch.setattr(hardware, "has_native_bf16", lambda: True)
    monkeypatch.setattr(step_timing, "training_step_timer",
                        fake_step_timer({torch.float32: 30.0, torch.bfloat16: 8.0}, timed))
    night = step_timing.choose_precision("auto", student, 8, 2, tmp_path, teacher, "muon", budget_s=8 * 3600)
    assert len(timed) == 1 and night["ab_batch"] >= 1 and night["dtype"] == "bfloat16"


def test_the_real_ab_times_both_precisions():
    from cpuforge.tasks.engine.step_timing import time_training_steps

    rates = time_training_steps(SMALL, 2, 1, (torch.float32, torch.bfloat16), teacher_cfg=SMALL, rounds=1)
    assert set(rates) == {torch.float32, torch.bfloat16} and all(r > 0 for r in rates.values())


def test_the_step_timer_runs_the_optimizer_the_run_uses():
    from cpuforge.tasks.engine.muon import MuonAdamW
    from cpuforge.tasks.engine.optimizers import newton_schulz_dtype
    from cpuforge.tasks.engine.step_timing import training_step_timer

    step = training_step_timer(SMALL, 2, "muon", activation_checkpointing=True)
    held = [c.cell_contents for c in step.__closure__]
    optimizers = [h for h in held if isinstance(h, torch.optim.Optimizer)]
    assert len(optimizers) == 1 and isinstance(optimizers[0], MuonAdamW)
    # Newton-Schulz runs in the step's precision as the trainer's optimizer does (make_optimizer): bf16
    # only where the CPU has it natively
    assert step(torch.bfloat16) > 0 and optimizers[0].ns_dtype == newton_schulz_dtype(torch.bfloat16)
    assert step() > 0 and optimizers[0].ns_dtype == torch.float32
    assert [h.activation_checkpointing for h in held if isinstance(h, torch.nn.Module)] == [True]


def test_newton_schulz_stays_fp32_where_bf16_is_emulated(monkeypatch):
    from cpuforge.tasks.engine import hardware
    from cpuforge.tasks.engine.optimizers import newton_schulz_dtype
    from cpuforge.tasks.engine.trainer import make_optimizer

    monkeypatch.setattr(hardware, "has_native_bf16", lambda: False)
    assert newton_schulz_dtype(torch.bfloat16) == torch.float32
    muon = load_config("tiny", overrides=["train.optimizer=muon"]).train
    assert make_optimizer(Llama(SMALL), muon, torch.bfloat16).ns_dtype == torch.float32  # a forced bf16 on AVX2
    monkeypatch.setattr(hardware, "has_native_bf16", lambda: True)
    assert newton_schulz_dtype(torch.float32) == torch.float32
    assert make_optimizer(Llama(SMALL), muon, torch.bfloat16).ns_dtype == torch.bfloat16


def test_recover_mfu_counts_the_teachers_forward_passes(shards, tmp_path):
    from cpuforge.models.checkpoint import save_model
    from cpuforge.models.llama import flops_per_token
    from cpuforge.tasks.engine.data import token_byte_lengths, val_batches
    from cpuforge.tasks.engine.trainer import train
    from cpuforge.tasks.engine.training_run import _build

    s = open_shards(shards, 64)
    teacher_cfg = LlamaConfig(vocab_size=s.vocab_size, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_mlp=176, block_size=64)
    student_cfg = LlamaConfig(vocab_size=s.vocab_size, n_layer=2, n_head=2, n_kv_head=1, d_model=64, d_mlp=96, block_size=64)
    save_model(Llama(teacher_cfg), tmp_path / "teacher")
    save_model(Llama(student_cfg), tmp_path / "student")
    spec = spec_for(shards, tmp_path / "out", "train.max_steps=2", "recover.max_steps=2").model_copy(
        update={"kind": "recover", "model": None, "student_dir": str(tmp_path / "student"),
                "teacher_dir": str(tmp_path / "teacher")})
    model, loss_fn, settings, facts = _build(spec)
    expected = flops_per_token(student_cfg) + flops_per_token(teacher_cfg) / 3
    assert facts.flops_per_token == pytest.approx(expected)
    assert flops_per_token(teacher_cfg, backward=False) == pytest.approx(flops_per_token(teacher_cfg) / 3)
    result = train(model, s.train, val_batches(s.val, 1, 8, 64), token_byte_lengths(s.tokenizer_path), settings,
                   tmp_path / "ck", facts, loss_fn=loss_fn)
    assert result.mfu == pytest.approx(result.tokens_per_s * expected / facts.peak_flops)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_recover_trains_with_recover_optimizer(shards, tmp_path, optimizer):
    from cpuforge.models.checkpoint import save_model
    from cpuforge.tasks.engine.data import token_byte_lengths, val_batches
    from cpuforge.tasks.engine.muon import MuonAdamW
    from cpuforge.tasks.engine.trainer import make_optimizer, train
    from cpuforge.tasks.engine.training_run import _build, step_optimizer

    s = open_shards(shards, 64)
    teacher_cfg = LlamaConfig(vocab_size=s.vocab_size, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_mlp=176, block_size=64)
    student_cfg = LlamaConfig(vocab_size=s.vocab_size, n_layer=2, n_head=2, n_kv_head=1, d_model=64, d_mlp=96, block_size=64)
    save_model(Llama(teacher_cfg), tmp_path / "teacher")
    save_model(Llama(student_cfg), tmp_path / "student")
    # pretraining's optimizer is the other one: recovery must not follow it
    other = "adamw" if optimizer == "muon" else "muon"
    spec = spec_for(shards, tmp_path / "out", f"train.optimizer={other}", "recover.max_steps=2",
                    "recover.max_minutes=null", "recover.lr=3e-3", f"recover.optimizer={optimizer}",
                    "recover.muon_lr=5e-3").model_copy(
        update={"kind": "recover", "model": None, "student_dir": str(tmp_path / "student"),
                "teacher_dir": str(tmp_path / "teacher")})
    assert step_optimizer("recover", spec.train, spec.recover) == optimizer  # what the precision A/B times
    model, loss_fn, settings, facts = _build(spec)
    train(model, s.train, val_batches(s.val, 1, 8, 64), token_byte_lengths(s.tokenizer_path), settings,
          tmp_path / "ck", facts, loss_fn=loss_fn)
    state = torch.load(next((tmp_path / "ck").glob("step-*/trainer.pt")), weights_only=True)
    assert state["optimizer"] == optimizer
    opt = make_optimizer(model, settings)
    assert isinstance(opt, MuonAdamW) == (optimizer == "muon")
    peaks = sorted({g["lr"] for g in opt.param_groups})
    assert peaks == ([3e-3, 5e-3] if optimizer == "muon" else [3e-3])
