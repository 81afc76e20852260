"""Every bad input the CLI can be given ends in one `error:` line (exit 2) naming what to fix, never a
traceback. Most cases run `flows.cli.main` in-process; argv bytes and file permissions need a real
subprocess (as an unprivileged user, since root may write anywhere)."""

from __future__ import annotations

import importlib.util
import io
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models

from cpuforge.flows.cli import main, terminal_safe
from cpuforge.flows.session import check_before_opening
from cpuforge.models.checkpoint import save_model
from cpuforge.models.config import LlamaConfig
from cpuforge.models.llama import Llama
from cpuforge.models.runtime import choose_token
from cpuforge.tasks import stages
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.records.summary import new_summary, write_summary
from tests.conftest import as_unprivileged

ROOT = Path(__file__).resolve().parents[1]


def one_error(code: int, err: str) -> str:
    """The single error line, after checking the exit code and that nothing else went wrong."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def cli(capsys, *argv: str) -> str:
    code = main(list(argv))
    return one_error(code, capsys.readouterr().err)


def cli_subprocess(argv: list[str | bytes]) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_HOME": tempfile.mkdtemp(prefix="cpuforge-prefect-")}
    proc = subprocess.run([sys.executable, "-m", "cpuforge.flows.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                          timeout=120)
    return one_error(proc.returncode, proc.stderr.decode("utf-8", "replace"))


# --- where the run writes ---------------------------------------------------------------------


def test_workdir_that_is_a_file(capsys, tmp_path):
    (tmp_path / "runs").write_text("not a folder")
    line = cli(capsys, "run", "--profile", "tiny", "--workdir", str(tmp_path / "runs"))
    assert f"--workdir {tmp_path / 'runs'} is a file, not a folder" in line


def test_workdir_below_a_file(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    line = cli(capsys, "compress", "--profile", "tiny", "--workdir", str(tmp_path / "f" / "runs"))
    assert f"{tmp_path / 'f'} is a file, not a folder" in line


def test_empty_workdir(capsys):
    assert "--workdir is empty" in cli(capsys, "run", "--profile", "tiny", "--workdir", "")


@pytest.mark.parametrize("command, flag, stage", [("run", "--stop-after", "pretrian"), ("run", "--rebuild", "evaluat"),
                                                 ("compress", "--stop-after", "pretrain")])  # compress has adopt instead
def test_a_stage_name_that_does_not_exist_names_the_stages(capsys, tmp_path, command, flag, stage):
    line = cli(capsys, command, "--profile", "tiny", "--workdir", str(tmp_path / "w"), flag, stage)
    assert line.startswith(f"error: {flag}: unknown stage '{stage}'; the stages are tokenize, ")
    assert not (tmp_path / "w" / "stages").exists()  # nothing ran


def test_summary_that_is_a_folder(capsys, tmp_path):
    line = cli(capsys, "run", "--profile", "tiny", "--workdir", str(tmp_path / "w"), "--summary", str(tmp_path))
    assert f"--summary {tmp_path} is a folder: give a file path such as {tmp_path / 'summary.json'}" in line


def test_summary_below_a_file(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    line = cli(capsys, "run", "--profile", "tiny", "--workdir", str(tmp_path / "w"),
               "--summary", str(tmp_path / "f" / "summary.json"))
    assert f"--summary {tmp_path / 'f' / 'summary.json'}: {tmp_path / 'f'} is a file" in line


@pytest.mark.parametrize("flag", ["--workdir", "--summary"])
def test_unwritable_workdir_or_summary_for_an_unprivileged_user(shared_tmp, flag):
    locked = shared_tmp / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    argv = ["run", "--profile", "tiny", "--workdir", str(shared_tmp / "w")]
    if flag == "--workdir":
        argv[-1] = str(locked / "w")
    else:
        argv += ["--summary", str(locked / "summary.json")]
    code, err = as_unprivileged(main, argv)
    line = one_error(code, err)
    assert line.startswith(f"error: {flag} {locked}")
    assert "(Permission denied); choose a place you can write to" in line


def test_a_summary_copy_that_fails_at_the_end_is_a_warning(tmp_path, caplog):
    """Written by the flow however it ended: a copy that cannot be written must not hide the result."""
    cfg = load_config("tiny")
    summary = new_summary("r1", cfg, tmp_path)
    (tmp_path / "f").write_text("x")
    with caplog.at_level(logging.WARNING, logger="cpuforge"):
        written = write_summary(summary, cfg, str(tmp_path / "f" / "summary.json"))
    assert written.is_file()
    assert f"could not write the summary copy to {tmp_path / 'f' / 'summary.json'}" in caplog.text


# --- generate ---------------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--top-k", "-1"], "--top-k -1: must be 0 (no top-k filtering) or a positive number"),
    (["--temperature", "-0.5"], "--temperature -0.5: must be 0 (greedy) or a positive number"),
    (["--temperature", "nan"], "--temperature nan: must be 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be positive"),
])
def test_generate_rejects_bad_sampling_settings(capsys, args, message):
    assert message in cli(capsys, "generate", "--model", "unused", "--prompt", "def ", *args)


def test_prompt_that_is_not_utf8():
    line = cli_subprocess(["generate", "--model", "unused", "--prompt", b"caf\xe9 au lait"])
    assert line == "error: --prompt is not valid UTF-8 text (byte 0xe9 at character 3): pass it as UTF-8"


def test_top_k_zero_samples_from_every_token():
    logits = torch.arange(5.0)
    generator = torch.Generator().manual_seed(0)
    assert {choose_token(logits, 100.0, 0, generator) for _ in range(200)} == {0, 1, 2, 3, 4}
    assert {choose_token(logits, 100.0, 1, generator) for _ in range(50)} == {4}


def test_terminal_safe_escapes_controls_but_keeps_newlines_and_tabs():
    assert terminal_safe("a\tb\nc") == "a\tb\nc"
    assert terminal_safe("\x1b]0;owned\x07\x1b[2J\r\x9b\u202e!") == r"\x1b]0;owned\x07\x1b[2J\x0d\x9b\u202e!"


@pytest.fixture
def control_model(tmp_path) -> Path:
    """A real (random) model whose every token holds a control character, so any output contains some."""
    vocab = {"\x1b[2J": 0, "\x07": 1, "\x1b]0;pwned\x07": 2, "\x9b": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="\x07"))
    torch.manual_seed(0)
    folder = tmp_path / "model"
    save_model(Llama(LlamaConfig(vocab_size=4, n_layer=1, n_head=2, n_kv_head=1, d_model=16, d_mlp=32,
                                 block_size=32)), folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_generate_escapes_control_characters_on_a_terminal_only(control_model, monkeypatch, capsys):
    argv = ["generate", "--model", str(control_model), "--prompt", "\x07", "--max-new-tokens", "6",
            "--top-k", "0", "--seed", "1"]
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert main(argv) == 0
    shown = terminal.getvalue()
    assert shown.startswith(r"\x07") and not any(c in shown for c in "\x1b\x07\x9b")
    monkeypatch.undo()
    assert main(argv) == 0
    piped = capsys.readouterr().out
    assert piped.startswith("\x07") and terminal_safe(piped) == shown  # piped: the text as it is


# --- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize("override, message", [
    ("train.betas=[0.9,2]", "train.betas[1]: Input should be less than 1 (got 2)"),
    ("train.betas=[-0.1,0.9]", "train.betas[0]: Input should be greater than or equal to 0"),
    ("tracking.experiment=''", "tracking.experiment: must not be empty"),
    ("tracking.registered_model='  '", "tracking.registered_model: must not be empty"),
    ("data.source=''", "data.source: must not be empty"),
    ("tokenizer.path=''", "tokenizer.path: must not be empty"),
    ("train.lr=.inf", "train.lr: Input should be a finite number"),
    ("recover.temperature=.nan", "recover.temperature: Input should be a finite number"),
    ("eval.prompts=['def ', '']", "eval.prompts[1]: String should have at least 1 character"),
])
def test_invalid_settings_name_the_field(capsys, override, message):
    line = cli(capsys, "config", "--profile", "tiny", "--set", override)
    assert line.startswith("error: invalid configuration: ") and message in line


@pytest.mark.parametrize("override", ["prune.width_multiple=8", "prune.d_mlp=100"])
def test_prune_widths_the_gguf_files_cannot_hold_fail_before_any_stage_runs(capsys, tmp_path, override):
    line = cli(capsys, "run", "--profile", "tiny", "--workdir", str(tmp_path / "w"), "--set", override)
    assert line.startswith(f"error: {override}: the pruned model's rows would not split into the 32-value blocks of the "
                           "gguf stage's Q8_0 and Q4_0 files; use multiples of 32, or --stop-after quantize")
    assert not (tmp_path / "w" / "stages").exists()
    check_before_opening(stages.up_to("quantize"), load_config("tiny", overrides=[override]))  # no GGUF files: fine


def test_a_dask_runner_without_its_extra_fails_before_any_stage_runs(capsys, tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "prefect_dask" else real_find_spec(name, *a))
    line = cli(capsys, "run", "--profile", "tiny", "--workdir", str(tmp_path / "w"), "--set", "data.encode_runner=dask")
    assert line == ("error: tokenizing on Dask (data.encode_runner=dask) needs prefect-dask: "
                    "pip install 'cpuforge[dask]'")
    assert not (tmp_path / "w" / "stages").exists()


def test_config_file_that_is_not_yaml_is_one_line(capsys, tmp_path):
    (tmp_path / "c.yaml").write_text("train:\n  lr: [1\n")
    line = cli(capsys, "config", "--config", str(tmp_path / "c.yaml"))
    assert line.startswith(f"error: config file {tmp_path / 'c.yaml'} is not valid YAML: while parsing")


def test_unreadable_config_and_text_files_for_an_unprivileged_user(shared_tmp):
    for name in ("c.yaml", "t.txt"):
        (shared_tmp / name).write_text("train: {}\n")
        (shared_tmp / name).chmod(0o000)
    code, err = as_unprivileged(main, ["config", "--config", str(shared_tmp / "c.yaml")])
    assert one_error(code, err) == f"error: cannot read the config file {shared_tmp / 'c.yaml'} (Permission denied)"
    code, err = as_unprivileged(main, ["evaluate", "--model", "unused", "--text", str(shared_tmp / "t.txt")])
    assert one_error(code, err) == f"error: --text {shared_tmp / 't.txt'}: cannot read it (Permission denied)"
