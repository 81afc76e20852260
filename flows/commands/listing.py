"""`cpuforge runs` and `cpuforge models`: past pipeline runs, and the registered versions with their alias history."""

from __future__ import annotations

import argparse
import json
import os

from cpuforge.flows.commands.common import add_command, existing_workdir, print_rows
from cpuforge.tasks.records.errors import UserError


def store_args(p: argparse.ArgumentParser, workdir_help: str) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--workdir", help=workdir_help + " (default: ./cpuforge-runs)")
    where.add_argument("--tracking-uri", help="an MLflow store or server, e.g. http://127.0.0.1:5000")
    p.add_argument("--json", action="store_true", help="print JSON, for scripts")


def add_runs(sub: argparse._SubParsersAction) -> None:
    runs = add_command(sub, "runs", "list past pipeline runs, newest first",
                       "One line per run: start time, profile, data source, status, seconds, final bits per byte and "
                       "the registry's decision; from the run summaries in a work folder, or from the parent runs on an "
                       "MLflow server (runs killed with kill -9 write no summary: only the server lists them).",
                       ("cpuforge runs", "cpuforge runs --workdir /data/cpuforge --limit 5",
                        "cpuforge runs --tracking-uri http://127.0.0.1:5000 --json"))
    store_args(runs, "the work folder whose run summaries to list")
    runs.add_argument("--experiment", default="cpuforge", help="with --tracking-uri: the MLflow experiment")
    runs.add_argument("--limit", type=int, default=20, help="at most this many runs")
    runs.set_defaults(handler=list_runs)


def add_models(sub: argparse._SubParsersAction) -> None:
    models = add_command(sub, "models", "list the registered model versions and the history of every alias move",
                         "Each version with its aliases (champion, candidate), bits per byte, size, decode speed and the "
                         "gate's decision; then every alias move: when, who, which version, and why.",
                         ("cpuforge models", "cpuforge models --workdir /data/cpuforge --json",
                          "cpuforge models --tracking-uri http://127.0.0.1:5000 --name cpuforge-lm"))
    store_args(models, "the work folder whose MLflow store to read")
    models.add_argument("--name", default="cpuforge-lm", help="the registered model")
    models.set_defaults(handler=list_models)


def list_runs(args: argparse.Namespace) -> int:
    from cpuforge.tasks.release import listing

    if args.limit <= 0:
        raise UserError(f"--limit {args.limit}: must be a positive number of runs")
    if args.tracking_uri:
        rows = listing.runs_in_store(args.tracking_uri, args.experiment, args.limit)
        where = f"{args.tracking_uri} (experiment {args.experiment})"
    else:
        workdir = existing_workdir(args.workdir)
        rows = listing.runs_in_workdir(workdir, args.limit)
        where = str(workdir)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no pipeline runs in {where}")
        return 0
    print_rows(f"pipeline runs in {where}", listing.RUN_COLUMNS, rows)
    return 0


def models_store(args: argparse.Namespace) -> str:
    """--tracking-uri, else $MLFLOW_TRACKING_URI unless --workdir was given, else the work folder's store."""
    if args.tracking_uri:
        return args.tracking_uri
    if args.workdir is None and os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    store = existing_workdir(args.workdir) / "mlflow.db"
    if not store.is_file():
        raise UserError(f"there is no MLflow store in {store.parent}: run the pipeline there first, "
                        "or pass --tracking-uri")
    return f"sqlite:///{store}"


def list_models(args: argparse.Namespace) -> int:
    from cpuforge.tasks.release import listing

    uri = models_store(args)
    found = listing.models(args.name, uri)
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    if not found["versions"]:
        print(f"{args.name} has no registered versions in {uri}")
        return 0
    rows = [{**v, "aliases": ",".join(v["aliases"]) or "-",
             "MB": v["file_bytes"] / 1e6 if v["file_bytes"] is not None else None} for v in found["versions"]]
    print_rows(f"{args.name} in {uri}", ("version", "created_at", "aliases", "val_bpb", "params", "MB",
                                         "decode_tok_s", "decision", "mlflow_run_id"), rows)
    print("\nalias history (oldest first):")
    for move in found["alias_history"]:
        print(f"  {move['at']}  {move['alias']} -> version {move['version']} (was {move['previous'] or 'unset'})"
              f"  by {move['by']}: {move['why']}")
    if not found["alias_history"]:
        print("  none recorded (versions registered before cpuforge recorded alias moves)")
    return 0
