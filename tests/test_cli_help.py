"""Help that teaches: every subcommand's --help says what it does, shows its defaults and examples;
`cpuforge config --explain` documents every setting; `cpuforge --version`."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from importlib.metadata import version

import pytest

from cpuforge.flows.cli import _parser, main
from cpuforge.tasks.config.settings import SECTIONS, load_config


def subcommands() -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def help_of(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_every_subcommand_explains_itself_with_defaults_and_examples(command, capsys):
    text = help_of([command, "--help"], capsys)
    description = text.split("\n\n")[1]
    assert len(description.split()) >= 8, description  # a sentence, not a label
    examples = [line.strip() for line in text.split("examples:\n", 1)[1].splitlines() if line.strip()]
    assert len(examples) >= 2 and all(e.startswith(f"cpuforge {command}") for e in examples), examples
    flat = " ".join(text.split())
    for action in subcommands()[command]._actions:
        if action.default not in (None, False, "", [], argparse.SUPPRESS) and action.help:
            assert f"(default: {action.default})" in flat, (action.dest, flat)


def test_top_level_help_lists_the_commands_and_examples(capsys):
    text = help_of(["--help"], capsys)
    for command in subcommands():
        assert re.search(rf"^\s+{command}\s+\w", text, re.M), command
    assert "examples:" in text and "--version" in text


def test_version_prints_the_installed_version():
    out = subprocess.run([sys.executable, "-m", "cpuforge.flows.cli", "--version"], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == f"cpuforge {version('cpuforge')}"


def test_config_explain_documents_every_setting_with_its_value(capsys):
    assert main(["config", "--explain", "--profile", "tiny", "--set", "train.lr=0.01"]) == 0
    text = capsys.readouterr().out
    resolved = load_config("tiny", overrides=["train.lr=0.01"]).model_dump(mode="json")
    for section, cls in SECTIONS.items():
        for key, field in cls.model_fields.items():
            name = f"{section}.{key}"
            [line] = [x for x in text.splitlines() if x[2:].startswith(f"{name}: ")]
            value = resolved[section][key]
            shown = "null" if value is None else value if isinstance(value, str) else json.dumps(value)
            assert line.endswith(f"tiny: {shown}"), line
            assert " default: " in line
            assert field.description and field.description.split()[0] in text.split(line, 1)[1][:300], name
    assert "* train.lr: float  default: 0.002  tiny: 0.01" in text  # overridden: marked as differing
    assert "  train.seed: int  default: 1337  tiny: 1337" in text
    assert "'auto' | 'fp32' | 'bf16'" in text  # a choice shows its choices


def test_config_without_explain_still_prints_yaml_that_loads(tmp_path, capsys):
    assert main(["config", "--profile", "tiny"]) == 0
    (tmp_path / "c.yaml").write_text(capsys.readouterr().out)
    assert load_config(config_file=tmp_path / "c.yaml") == load_config("tiny")
