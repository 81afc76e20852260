"""What the command modules share: the help layout, the option groups several commands take, and table printing."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

from cpuforge.tasks.records.errors import UserError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default (where there is one to show) and keeps the examples' line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, "", [], argparse.SUPPRESS) or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def positive_seconds(text: str) -> float:
    """argparse type: a number of seconds above 0 (argparse prints the usage and this line on anything else)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be more than 0 seconds")
    return value


def wrap(text: str) -> str:  # the formatter keeps line breaks (for the examples), so descriptions come wrapped
    return textwrap.fill(text, width=min(100, shutil.get_terminal_size().columns - 2))


def examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def add_command(sub: argparse._SubParsersAction, name: str, summary: str, description: str,
                example_lines: tuple[str, ...]) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=summary, description=wrap(f"{summary[0].upper()}{summary[1:]}. {description}"),
                          epilog=examples(*example_lines), formatter_class=HelpFormatter)


def config_args(p: argparse.ArgumentParser) -> None:
    from cpuforge.tasks.config.settings import DEFAULT_PROFILE, available_profiles

    p.add_argument("--profile", help=f"named preset of every setting: {' | '.join(available_profiles())} "
                                     f"(default: {DEFAULT_PROFILE}; see `cpuforge config --explain`)")
    p.add_argument("--config", help="YAML file of config sections, applied over the profile")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one setting; repeatable")


def existing_workdir(workdir: str | None) -> Path:
    folder = Path(workdir or "cpuforge-runs").expanduser().resolve()
    if not folder.is_dir():
        raise UserError(f"--workdir {folder}: no such folder (give the folder `cpuforge run --workdir` "
                        "wrote to)")
    return folder


def champion_or(model: str | None, workdir: str | None, tracking_uri: str | None,
                registered_model: str) -> tuple[str, str | None, Path]:
    """(the model spec, the MLflow store its models:/ or runs:/ URI needs, the work folder) for commands that
    act on a finished model: MODEL left out means the work folder's champion, read from its own store unless
    --tracking-uri or $MLFLOW_TRACKING_URI names one."""
    import os

    folder = Path(workdir or "cpuforge-runs").expanduser().resolve()
    model = model or f"models:/{registered_model}@champion"
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if model.startswith(("models:/", "runs:/")) and not uri:
        if not (folder / "mlflow.db").is_file():
            raise UserError(f"{model} needs an MLflow store: no {folder / 'mlflow.db'} (give --workdir, the folder "
                            "`cpuforge run` wrote to, or --tracking-uri, or a MODEL path)")
        uri = f"sqlite:///{folder / 'mlflow.db'}"
    return model, uri, folder


def print_rows(title: str, columns: tuple[str, ...], rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        # Bits per byte to 4 decimals: runs often differ in the third.
        table.add_row(*("-" if row.get(c) is None else f"{row[c]:.4f}" if c.endswith("bpb") else fmt(row[c])
                        for c in columns))
    (Console() if sys.stdout.isatty() else Console(width=200)).print(table)


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return json.dumps(value) if not isinstance(value, str) else value
