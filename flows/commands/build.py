"""`cpuforge run`, `plan` and `compress`: the commands that build stages (or show what they would build).
Each resolves its settings once (tasks/config/resolve.py), checks everything cheap, then runs the flow."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from cpuforge.flows.commands.common import add_command, config_args, fmt
from cpuforge.tasks.records.errors import UserError


def run_args(p: argparse.ArgumentParser, summary: bool = True) -> None:
    config_args(p)
    p.add_argument("--workdir", default="cpuforge-runs", help="stage outputs, summaries, MLflow store")
    if summary:
        p.add_argument("--summary", help="also write the summary JSON to this file")
    p.add_argument("--rebuild", metavar="STAGE", default="",
                   help="build this stage and every stage that reads its output again, even where the work folder has them")
    if summary:  # run and compress, not plan
        p.add_argument("--verbose", action="store_true",
                       help="keep the progress bars of the libraries the run drives (MLflow, datasets, the Hub)")
        p.add_argument("--stop-after", metavar="STAGE", default="",
                       help="run the stages up to and including STAGE, then stop (the model is registered only when "
                            "evaluate ran); finished stages are kept and reused by the next run")


def add_run(sub: argparse._SubParsersAction) -> None:
    run = add_command(sub, "run", "run the whole pipeline",
                      "Stages whose inputs, settings and code are unchanged are reused from --workdir (shown as Cached "
                      "in Prefect); the rest are built and tracked in MLflow (one parent run, a nested run per stage). "
                      "The final model is registered, and becomes 'champion' when it beats the current one.",
                      ("cpuforge run --profile tiny --workdir /tmp/cpuforge-tiny",
                       "cpuforge run --set data.source=~/code --set train.max_minutes=30",
                       "cpuforge run --config my.yaml --rebuild recover   # recover and every stage that reads it, again",
                       "cpuforge run --stop-after pretrain   # tokenize and pretrain only"))
    run_args(run)
    run.set_defaults(handler=run_pipeline)


def add_plan(sub: argparse._SubParsersAction) -> None:
    plan = add_command(sub, "plan", "show what `run` with the same arguments would reuse and build, and why",
                       "Nothing is run: each stage's key is computed and looked up in --workdir.",
                       ("cpuforge plan --profile tiny --workdir /tmp/cpuforge-tiny",
                        "cpuforge plan --set train.lr=1e-3 --json"))
    run_args(plan, summary=False)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(handler=show_plan)


def add_compress(sub: argparse._SubParsersAction) -> None:
    from cpuforge.tasks import stages

    after_adopt = stages.names(stages.COMPRESS)[stages.COMPRESS.index(stages.ADOPT) + 1:]
    comp = add_command(sub, "compress", f"{', '.join(after_adopt)} and register an existing pretrained model",
                       "No pretraining: the model comes from --pretrained, the data (for calibration, "
                       "distillation and evaluation) from the config.",
                       ("cpuforge compress --profile tiny   # the registered champion's pretrained weights",
                        "cpuforge compress --pretrained runs:/RUN_ID/model --set prune.keep_ratio=0.3",
                        "cpuforge compress --pretrained cpuforge-runs/stages/pretrain-KEY",
                        "cpuforge compress --pretrained hf:./SmolLM2-135M --stop-after prune   # see the pruned model first"))
    run_args(comp)
    comp.add_argument("--pretrained", default="champion", metavar="SOURCE",
                      help="'champion' (default: the registered champion's pretrained weights), runs:/RUN_ID/model, "
                           "a pretrain stage output or model folder, or hf:DIR_OR_ID (a transformers Llama "
                           "checkpoint with its tokenizer.json: a folder, or a Hugging Face Hub id)")
    comp.set_defaults(handler=run_compress)


def run_pipeline(args: argparse.Namespace) -> int:
    workdir = checked_outputs(args)
    rebuild_set(args.rebuild)
    stop_after_set(args.stop_after)
    run = resolved(args, workdir)
    run.check_pretrained()  # train.init_from=hf:DIR
    run.check_prune_target()
    from cpuforge.flows.pipeline import pipeline

    return run_flow(pipeline, args.verbose, profile=run.cfg.profile, config_file=args.config or "", overrides=args.overrides,
                    workdir=workdir, summary_path=args.summary or "", rebuild=args.rebuild, stop_after=args.stop_after)


def show_plan(args: argparse.Namespace) -> int:
    from cpuforge.flows import plan as planning

    run = resolved(args, args.workdir)
    rows = planning.plan(run, rebuild_set(args.rebuild))
    if args.json:
        print(planning.as_json(rows))
        return 0
    width = max(len(row.stage) for row in rows)
    for row in rows:
        folder = os.path.relpath(row.folder, Path.cwd()) if row.folder else ""
        detail = folder if row.action == "reuse" else f"-> {folder}: " + "; ".join(row.reasons)
        print(f"{row.stage:<{width}}  {row.action:<5}  {detail}")
    return 0


def run_compress(args: argparse.Namespace) -> int:
    from cpuforge.tasks import stages

    workdir = checked_outputs(args)
    rebuild_set(args.rebuild, stages.COMPRESS)
    stop_after_set(args.stop_after, stages.COMPRESS)
    run = resolved(args, workdir, args.pretrained)  # the prune target is checked once the model's shape is known
    run.check_pretrained()
    from cpuforge.flows.compress import compress

    return run_flow(compress, args.verbose, pretrained=args.pretrained, profile=run.cfg.profile, config_file=args.config or "",
                    overrides=args.overrides, workdir=workdir, summary_path=args.summary or "", rebuild=args.rebuild,
                    stop_after=args.stop_after)


def resolved(args: argparse.Namespace, workdir: str, pretrained: str = ""):
    """The command's settings resolved, with the data source checked: a wrong path fails here, before any work."""
    from cpuforge.tasks.config.resolve import resolve_run

    run = resolve_run(args.profile, args.config, args.overrides, workdir, pretrained)
    run.check_data()
    return run


def rebuild_set(rebuild: str, order=None) -> frozenset[str]:
    """Check `--rebuild` up front: a stage name that does not exist fails now, in one line."""
    from cpuforge.tasks import stages

    if not rebuild:
        return frozenset()
    try:
        return stages.from_stage(rebuild, order or stages.PIPELINE)
    except ValueError as exc:
        raise UserError(f"--rebuild: {exc}") from None


def stop_after_set(stop_after: str, order=None) -> None:
    """Check `--stop-after` up front: a stage name that does not exist fails now, in one line."""
    from cpuforge.tasks import stages

    if stop_after:
        try:
            stages.up_to(stop_after, order or stages.PIPELINE)
        except ValueError as exc:
            raise UserError(f"--stop-after: {exc}") from None


def checked_outputs(args: argparse.Namespace) -> str:
    """Check where the run will write before any work: a bad path fails now, not after the training.
    Returns the workdir, created and resolved."""
    if not args.workdir.strip():
        raise UserError("--workdir is empty: give the folder for the run's outputs")
    workdir = Path(args.workdir).expanduser().resolve()
    if workdir.exists() and not workdir.is_dir():
        raise UserError(f"--workdir {workdir} is a file, not a folder: give a folder (it is created if missing)")
    writable_folder(workdir, f"--workdir {workdir}")
    if args.summary is not None:
        if not args.summary.strip():
            raise UserError("--summary is empty: give a file path such as summary.json, or leave it out")
        summary = Path(args.summary).expanduser().resolve()
        if summary.is_dir():
            raise UserError(f"--summary {summary} is a folder: give a file path such as {summary / 'summary.json'}")
        writable_folder(summary.parent, f"--summary {summary}")
    return str(workdir)


def writable_folder(folder: Path, flag: str) -> None:
    """Create `folder` if needed and prove it writable by writing into it (permissions, a read-only mount)."""
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p.is_symlink())
    if not existing.is_dir():
        raise UserError(f"{flag}: {existing} is a file, not a folder; choose a place you can write to")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{flag}: cannot create the folder {folder} ({exc.strerror}); "
                        "choose a place you can write to") from None
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".cpuforge-write-check-")
    except OSError as exc:
        raise UserError(f"{flag}: cannot write into {folder} ({exc.strerror}); "
                        "choose a place you can write to") from None
    os.close(fd)
    os.unlink(probe)


_reaper = None


def run_flow(flow_fn, verbose: bool = False, **params: Any) -> int:
    global _reaper
    if verbose:  # read by tasks/infra/tracking.quiet_library_progress, here and in the processes the run starts
        from cpuforge.tasks.infra.tracking import VERBOSE_ENV

        os.environ[VERBOSE_ENV] = "1"
    if _reaper is None:  # whatever ends this process, what it started (Prefect's API server...) ends too
        from cpuforge.flows import reaper

        _reaper = reaper.start()
    _quiet_user_error_tracebacks()
    logging.getLogger("cpuforge").setLevel(logging.INFO)
    try:
        summary = flow_fn(**params)
    except UserError:
        raise
    except Exception as exc:
        if _disk_full(exc):
            where = params.get("workdir", "")
            print(f"error: the disk is full (writing {exc.filename or where}): free some space or choose a --workdir "
                  "on a larger disk, then run again; finished stages are kept and will be reused", file=sys.stderr)
            return 1
        print(f"error: the pipeline failed: {type(exc).__name__}: {exc} (details in the log above)", file=sys.stderr)
        return 1
    from cpuforge.tasks.records.summary import RunSummary

    print_summary(RunSummary.model_validate(summary))
    return 0


def print_summary(summary) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"cpuforge run {summary.run_id} ({summary.profile})")
    for column in ("stage", "status", "seconds", "headline metrics", "output"):
        table.add_column(column, overflow="fold")
    for stage, entry in summary.stages.items():
        metrics = ", ".join(f"{k}={fmt(v)}" for k, v in list(entry.metrics.items())[:8])
        seconds = entry.seconds if entry.seconds is not None else 0
        table.add_row(stage, entry.status, fmt(seconds), metrics, entry.output_dir or "")
    console = Console() if sys.stdout.isatty() else Console(width=160)
    console.print(table)
    uri = summary.mlflow_tracking_uri or ""
    if summary.registry:
        evaluated = summary.stages.get("evaluate")
        prompts = (evaluated.model_extra or {}).get("sample_prompts") if evaluated else None
        print_registry(console, summary.registry, uri, prompts[0] if prompts else "The ")
    console.print(f"summary: {Path(summary.run_dir) / 'summary.json'}")
    if uri.startswith("sqlite:"):
        console.print(f"MLflow UI: mlflow ui --backend-store-uri {uri}  (then open http://127.0.0.1:5000)")
    else:
        console.print(f"MLflow: {uri} (parent run {summary.mlflow_run_id})")


def print_registry(console, registry: dict[str, Any], uri: str, prompt: str) -> None:
    console.print(f"registry: {registry['model_uri']} (aliases: {', '.join(registry['aliases']) or 'none'}) "
                  f"{registry['decision']}: {registry['reason']}")
    default = f"sqlite:///{(Path('cpuforge-runs') / 'mlflow.db').resolve()}"
    store = "" if uri == default else f" --tracking-uri {uri}"
    console.print(f"try it: cpuforge generate --model {registry['champion_uri']}{store} --prompt {shlex.quote(prompt)}")
    if registry.get("serve"):
        console.print(f"serve it: MLFLOW_TRACKING_URI={uri} {registry['serve']} --port 5001")


def _disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


class _DropUserErrorTraceback(logging.Filter):
    """A user error (or a full disk) is reported in one line; Prefect would otherwise log its full traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and (isinstance(record.exc_info[1], UserError) or _disk_full(record.exc_info[1])):
            record.exc_info = None
            record.exc_text = None
        return True


def _quiet_user_error_tracebacks() -> None:
    for name in ("prefect.task_runs", "prefect.flow_runs", "prefect.flow_engine", "prefect.task_engine"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropUserErrorTraceback) for f in logger.filters):
            logger.addFilter(_DropUserErrorTraceback())

