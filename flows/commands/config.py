"""`cpuforge config`: the resolved configuration, as YAML or explained setting by setting."""

from __future__ import annotations

import argparse

from cpuforge.flows.commands.common import add_command, config_args


def add_config(sub: argparse._SubParsersAction) -> None:
    show = add_command(sub, "config", "print the resolved configuration and exit",
                       "The profile, then --config, then each --set, as `run` would use them (YAML, which --config "
                       "accepts). --explain prints each setting's description, type, default and resolved value instead.",
                       ("cpuforge config --profile tiny > my.yaml   # a starting point to edit",
                        "cpuforge config --explain --profile demo",
                        "cpuforge config --explain --set train.max_minutes=60"))
    config_args(show)
    show.add_argument("--explain", action="store_true",
                      help="describe every setting: what it does, its type, default and resolved value")
    show.set_defaults(handler=show_config)


def show_config(args: argparse.Namespace) -> int:
    from cpuforge.tasks.config.settings import load_config

    cfg = load_config(args.profile, args.config, args.overrides)
    if args.explain:
        from cpuforge.tasks.config.explain import explain

        print(explain(cfg), end="")
    else:
        print(cfg.to_yaml(), end="")
    return 0
