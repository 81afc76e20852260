"""`cpuforge` command line: the table of commands. Each command's options and handler live in its
module under flows/commands/; a handler validates everything cheap first, then does its work."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from cpuforge.flows.commands import build, config, convert, inference, listing, push, serve
from cpuforge.flows.commands.common import HelpFormatter, examples, wrap
from cpuforge.flows.commands.inference import terminal_safe  # noqa: F401  (tests and scripts import it from here)
from cpuforge.tasks import stages
from cpuforge.tasks.records.errors import UserError

# Prefect's ephemeral local API needs ~20 s to start on a busy 2-core machine (its default
# timeout), and its analytics service spews "database is locked" tracebacks there.
PREFECT_DEFAULTS = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_EXTRA_LOGGERS": "cpuforge",
    "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
}


def apply_prefect_defaults() -> None:
    """Must run before anything imports prefect: it reads these settings at import time."""
    for name, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(name, value)


def main(argv: list[str] | None = None) -> int:
    apply_prefect_defaults()
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; finished stages are kept and will be reused", file=sys.stderr)
        return 130


# Command name -> what adds its options and handler, in the order `cpuforge --help` lists them.
COMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {
    "run": build.add_run,
    "plan": build.add_plan,
    "compress": build.add_compress,
    "config": config.add_config,
    "generate": inference.add_generate,
    "evaluate": inference.add_evaluate,
    "export": convert.add_export,
    "quantize": convert.add_quantize,
    "runs": listing.add_runs,
    "models": listing.add_models,
    "serve": serve.add_serve,
    "push": push.add_push,
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cpuforge")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cpuforge", formatter_class=HelpFormatter,
        description=wrap(f"Train small language models on CPUs alone: {' -> '.join(stages.names())} -> register in "
                         "MLflow, as a Prefect flow. Every stage's output is kept in the work folder and reused by "
                         "the next run that needs it. `cpuforge COMMAND --help` explains each command."),
        epilog=examples("cpuforge run --profile tiny            # the whole pipeline in a few minutes",
                        "cpuforge config --explain --profile demo   # every setting, what it does, its value",
                        "cpuforge generate --model models:/cpuforge-lm@champion --prompt 'def '"))
    parser.add_argument("--version", action="version", version=f"cpuforge {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_command in COMMANDS.values():
        add_command(sub)
    return parser


if __name__ == "__main__":
    sys.exit(main())
