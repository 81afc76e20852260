"""`cpuforge` command line: validate everything cheap first, then run the Prefect flow locally."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

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


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default (where there is one to show) and keeps the examples' line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, "", [], argparse.SUPPRESS) or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _wrap(text: str) -> str:  # the formatter keeps line breaks (for the examples), so descriptions come wrapped
    return textwrap.fill(text, width=min(100, shutil.get_terminal_size().columns - 2))


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cpuforge")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cpuforge", formatter_class=_Help,
        description=_wrap("Train small language models on CPUs alone: tokenize -> pretrain -> prune -> recover "
                          "(distillation) -> export ONNX -> quantize int8 -> evaluate -> register in MLflow, as a "
                          "Prefect flow. Every stage's output is kept in the work folder and reused by the next "
                          "run that needs it. `cpuforge COMMAND --help` explains each command."),
        epilog=_examples("cpuforge run --profile tiny            # the whole pipeline in a few minutes",
                         "cpuforge config --explain --profile demo   # every setting, what it does, its value",
                         "cpuforge generate --model models:/cpuforge-lm@champion --prompt 'def '"))
    parser.add_argument("--version", action="version", version=f"cpuforge {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, summary: str, description: str, examples: tuple[str, ...]) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=_wrap(f"{summary[0].upper()}{summary[1:]}. {description}"),
                              epilog=_examples(*examples), formatter_class=_Help)

    from cpuforge.tasks.config.settings import DEFAULT_PROFILE, available_profiles

    def config_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--profile", help=f"named preset of every setting: {' | '.join(available_profiles())} "
                                         f"(default: {DEFAULT_PROFILE}; see `cpuforge config --explain`)")
        p.add_argument("--config", help="YAML file of config sections, applied over the profile")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one setting; repeatable")

    def run_args(p: argparse.ArgumentParser, summary: bool = True) -> None:
        config_args(p)
        p.add_argument("--workdir", default="cpuforge-runs", help="stage outputs, summaries, MLflow store")
        if summary:
            p.add_argument("--summary", help="also write the summary JSON to this file")
        p.add_argument("--rebuild", metavar="STAGE", default="",
                       help="build this stage and every stage that reads its output again, even where the work folder has them")

    run = add("run", "run the whole pipeline",
              "Stages whose inputs, settings and code are unchanged are reused from --workdir (shown as Cached in "
              "Prefect); the rest are built and tracked in MLflow (one parent run, a nested run per stage). "
              "The final model is registered, and becomes 'champion' when it beats the current one.",
              ("cpuforge run --profile tiny --workdir /tmp/cpuforge-tiny",
               "cpuforge run --set data.source=~/code --set train.max_minutes=30",
               "cpuforge run --config my.yaml --rebuild recover   # recover and every stage that reads it, again"))
    run_args(run)
    run.set_defaults(handler=_run)

    plan = add("plan", "show what `run` with the same arguments would reuse and build, and why",
               "Nothing is run: each stage's key is computed and looked up in --workdir.",
               ("cpuforge plan --profile tiny --workdir /tmp/cpuforge-tiny",
                "cpuforge plan --set train.lr=1e-3 --json"))
    run_args(plan, summary=False)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(handler=_plan)

    comp = add("compress", "prune, recover, export, quantize, evaluate and register an existing pretrained model",
               "No pretraining: the model comes from --pretrained, the data (for calibration, distillation and "
               "evaluation) from the config.",
               ("cpuforge compress --profile tiny   # the registered champion's pretrained weights",
                "cpuforge compress --pretrained runs:/RUN_ID/model --set prune.keep_ratio=0.3",
                "cpuforge compress --pretrained cpuforge-runs/stages/pretrain-KEY"))
    run_args(comp)
    comp.add_argument("--pretrained", default="champion", metavar="SOURCE",
                      help="'champion' (default: the registered champion's pretrained weights), runs:/RUN_ID/model, "
                           "a pretrain stage output or model folder, or hf:DIR_OR_ID (a transformers Llama "
                           "checkpoint with its tokenizer.json: a folder, or a Hugging Face Hub id)")
    comp.set_defaults(handler=_compress)

    show = add("config", "print the resolved configuration and exit",
               "The profile, then --config, then each --set, as `run` would use them (YAML, which --config "
               "accepts). --explain prints each setting's description, type, default and resolved value instead.",
               ("cpuforge config --profile tiny > my.yaml   # a starting point to edit",
                "cpuforge config --explain --profile demo",
                "cpuforge config --explain --set train.max_minutes=60"))
    config_args(show)
    show.add_argument("--explain", action="store_true",
                      help="describe every setting: what it does, its type, default and resolved value")
    show.set_defaults(handler=_show_config)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", required=True, metavar="PATH_OR_URI",
                       help="a model folder (PyTorch), an .onnx file, a stage output folder, or an MLflow "
                            "URI such as models:/cpuforge-lm@champion")
        p.add_argument("--tracking-uri", help="MLflow store for models:/ URIs (default: $MLFLOW_TRACKING_URI, "
                                              "else the store in ./cpuforge-runs)")

    gen = add("generate", "stream text from a model",
              "Any model cpuforge made: a PyTorch folder, an ONNX file (fp32 or int8), or a registered version.",
              ("cpuforge generate --model models:/cpuforge-lm@champion --prompt 'def '",
               "cpuforge generate --model cpuforge-runs/stages/quantize-KEY/model.int8.onnx --prompt 'import ' "
               "--temperature 0",
               "cpuforge generate --model runs:/RUN_ID/model --prompt 'class ' --seed 1 --max-new-tokens 50"))
    model_args(gen)
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy")
    gen.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest tokens; 0 = all")
    gen.add_argument("--seed", type=int, default=None, help="fix the sampling for a repeatable output")
    gen.set_defaults(handler=_generate)

    ev = add("evaluate", "bits per byte and perplexity of a model on a text file",
             "Bits per byte do not depend on the tokenizer, so models with different vocabularies compare fairly.",
             ("cpuforge evaluate --model models:/cpuforge-lm@champion --text notes.txt",
              "cpuforge evaluate --model cpuforge-runs/stages/recover-KEY --text notes.txt --json"))
    model_args(ev)
    ev.add_argument("--text", required=True, help="a UTF-8 text file, read with the model's own tokenizer")
    ev.add_argument("--json", action="store_true", help="print the result as JSON")
    ev.set_defaults(handler=_evaluate)

    def store_args(p: argparse.ArgumentParser, workdir_help: str) -> None:
        where = p.add_mutually_exclusive_group()
        where.add_argument("--workdir", help=workdir_help + " (default: ./cpuforge-runs)")
        where.add_argument("--tracking-uri", help="an MLflow store or server, e.g. http://127.0.0.1:5000")
        p.add_argument("--json", action="store_true", help="print JSON, for scripts")

    runs = add("runs", "list past pipeline runs, newest first",
               "One line per run: start time, profile, data source, status, seconds, final bits per byte and the "
               "registry's decision; from the run summaries in a work folder, or from the parent runs on an MLflow "
               "server (runs killed with kill -9 write no summary: only the server lists them).",
               ("cpuforge runs", "cpuforge runs --workdir /data/cpuforge --limit 5",
                "cpuforge runs --tracking-uri http://127.0.0.1:5000 --json"))
    store_args(runs, "the work folder whose run summaries to list")
    runs.add_argument("--experiment", default="cpuforge", help="with --tracking-uri: the MLflow experiment")
    runs.add_argument("--limit", type=int, default=20, help="at most this many runs")
    runs.set_defaults(handler=_runs)

    models = add("models", "list the registered model versions and the history of every alias move",
                 "Each version with its aliases (champion, candidate), bits per byte, size, decode speed and the gate's "
                 "decision; then every alias move: when, who, which version, and why.",
                 ("cpuforge models", "cpuforge models --workdir /data/cpuforge --json",
                  "cpuforge models --tracking-uri http://127.0.0.1:5000 --name cpuforge-lm"))
    store_args(models, "the work folder whose MLflow store to read")
    models.add_argument("--name", default="cpuforge-lm", help="the registered model")
    models.set_defaults(handler=_models)
    return parser


def _model_tracking_uri(args: argparse.Namespace) -> str | None:
    if args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"):
        return args.tracking_uri or os.environ["MLFLOW_TRACKING_URI"]
    default = Path("cpuforge-runs") / "mlflow.db"
    if args.model.startswith(("models:/", "runs:/")) and not default.is_file():
        raise UserError(f"{args.model} needs an MLflow store: pass --tracking-uri (no {default} here)")
    return f"sqlite:///{default.resolve()}"


def _generate(args: argparse.Namespace) -> int:
    if args.max_new_tokens <= 0:
        raise UserError("--max-new-tokens must be positive")
    if args.top_k < 0:
        raise UserError(f"--top-k {args.top_k}: must be 0 (no top-k filtering) or a positive number of tokens")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UserError(f"--temperature {args.temperature}: must be 0 (greedy) or a positive number")
    _check_utf8("--prompt", args.prompt)
    from cpuforge.models.runtime import check_prompt
    from cpuforge.tasks.release.register import open_model

    lm = open_model(args.model, _model_tracking_uri(args))
    try:
        check_prompt(len(lm.encode(args.prompt)), lm.cfg.block_size)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    # On a terminal, a model's output must not be able to move the cursor, retitle the window or worse.
    show = terminal_safe if sys.stdout.isatty() else str
    print(show(args.prompt), end="", flush=True)
    for piece in lm.stream(args.prompt, args.max_new_tokens, args.temperature, args.top_k or None, args.seed):
        print(show(piece), end="", flush=True)
    print()
    return 0


def _check_utf8(flag: str, value: str) -> None:
    """argv bytes that are not UTF-8 arrive as lone surrogates (PEP 383); the tokenizer would choke on them."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(value[exc.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"code point U+{code:04X}"
        raise UserError(f"{flag} is not valid UTF-8 text ({what} at character {exc.start}): "
                        "pass it as UTF-8") from None


# C0 and C1 controls except \t and \n, DEL, and the bidirectional overrides that reorder what is shown.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def terminal_safe(text: str) -> str:
    """Control characters shown as visible escapes (\\x1b, \\u202e), keeping newlines and tabs."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


def _evaluate(args: argparse.Namespace) -> int:
    path = Path(args.text).expanduser()
    if not path.is_file():
        raise UserError(f"text file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"--text {path}: cannot read it ({exc.strerror})") from None
    from cpuforge.tasks.engine.scoring import score_text
    from cpuforge.tasks.release.register import open_model

    lm = open_model(args.model, _model_tracking_uri(args))
    score = score_text(lm, text)
    result = {"model": args.model, "format": lm.kind, "params": lm.params, "text": str(path), **score.as_dict()}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{args.model} ({lm.kind}, {lm.params:,} params) on {path.name}: "
              f"{score.val_bpb:.4f} bits per byte, perplexity {score.ppl:.2f} "
              f"({score.tokens:,} tokens, {score.bytes:,} bytes)")
    return 0


def _runs(args: argparse.Namespace) -> int:
    from cpuforge.tasks.release import listing

    if args.limit <= 0:
        raise UserError(f"--limit {args.limit}: must be a positive number of runs")
    if args.tracking_uri:
        rows = listing.runs_in_store(args.tracking_uri, args.experiment, args.limit)
        where = f"{args.tracking_uri} (experiment {args.experiment})"
    else:
        workdir = _existing_workdir(args.workdir)
        rows = listing.runs_in_workdir(workdir, args.limit)
        where = str(workdir)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no pipeline runs in {where}")
        return 0
    _print_rows(f"pipeline runs in {where}", listing.RUN_COLUMNS, rows)
    return 0


def _models(args: argparse.Namespace) -> int:
    from cpuforge.tasks.release import listing

    if args.tracking_uri:
        uri = args.tracking_uri
    elif args.workdir is None and os.environ.get("MLFLOW_TRACKING_URI"):
        uri = os.environ["MLFLOW_TRACKING_URI"]
    else:
        store = _existing_workdir(args.workdir) / "mlflow.db"
        if not store.is_file():
            raise UserError(f"there is no MLflow store in {store.parent}: run the pipeline there first, "
                            "or pass --tracking-uri")
        uri = f"sqlite:///{store}"
    found = listing.models(args.name, uri)
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    if not found["versions"]:
        print(f"{args.name} has no registered versions in {uri}")
        return 0
    rows = [{**v, "aliases": ",".join(v["aliases"]) or "-",
             "MB": v["file_bytes"] / 1e6 if v["file_bytes"] is not None else None} for v in found["versions"]]
    _print_rows(f"{args.name} in {uri}", ("version", "created_at", "aliases", "val_bpb", "params", "MB",
                                          "decode_tok_s", "decision", "mlflow_run_id"), rows)
    print("\nalias history (oldest first):")
    for move in found["alias_history"]:
        print(f"  {move['at']}  {move['alias']} -> version {move['version']} (was {move['previous'] or 'unset'})"
              f"  by {move['by']}: {move['why']}")
    if not found["alias_history"]:
        print("  none recorded (versions registered before cpuforge recorded alias moves)")
    return 0


def _existing_workdir(workdir: str | None) -> Path:
    folder = Path(workdir or "cpuforge-runs").expanduser().resolve()
    if not folder.is_dir():
        raise UserError(f"--workdir {folder}: no such folder (give the folder `cpuforge run --workdir` "
                        "wrote to)")
    return folder


def _print_rows(title: str, columns: tuple[str, ...], rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        # Bits per byte to 4 decimals: runs often differ in the third.
        table.add_row(*("-" if row.get(c) is None else f"{row[c]:.4f}" if c.endswith("bpb") else _fmt(row[c])
                        for c in columns))
    (Console() if sys.stdout.isatty() else Console(width=200)).print(table)


def _show_config(args: argparse.Namespace) -> int:
    from cpuforge.tasks.config.settings import load_config

    cfg = load_config(args.profile, args.config, args.overrides)
    if args.explain:
        from cpuforge.tasks.config.explain import explain

        print(explain(cfg), end="")
    else:
        print(cfg.to_yaml(), end="")
    return 0


def _run(args: argparse.Namespace) -> int:
    workdir = _checked_outputs(args)
    _rebuild_set(args.rebuild)
    cfg = _checked_config(args)
    _check_prune_target(cfg)
    from cpuforge.flows.pipeline import pipeline

    return _run_flow(pipeline, profile=cfg.profile, config_file=args.config or "", overrides=args.overrides,
                     workdir=workdir, summary_path=args.summary or "", rebuild=args.rebuild)


def _plan(args: argparse.Namespace) -> int:
    from cpuforge.flows import plan as planning

    cfg = _checked_config(args)
    workdir = Path(args.workdir).expanduser().resolve()
    rows = planning.plan(cfg, workdir, _rebuild_set(args.rebuild))
    if args.json:
        print(planning.as_json(rows))
        return 0
    width = max(len(row.stage) for row in rows)
    for row in rows:
        folder = os.path.relpath(row.folder, Path.cwd()) if row.folder else ""
        detail = folder if row.action == "reuse" else f"-> {folder}: " + "; ".join(row.reasons)
        print(f"{row.stage:<{width}}  {row.action:<5}  {detail}")
    return 0


def _rebuild_set(rebuild: str, order=None) -> frozenset[str]:
    """Check `--rebuild` up front: a stage name that does not exist fails now, in one line."""
    from cpuforge.tasks import stages

    if not rebuild:
        return frozenset()
    try:
        return stages.from_stage(rebuild, order or stages.PIPELINE)
    except ValueError as exc:
        raise UserError(f"--rebuild: {exc}") from None


def _compress(args: argparse.Namespace) -> int:
    from cpuforge.tasks import stages

    workdir = _checked_outputs(args)
    _rebuild_set(args.rebuild, stages.COMPRESS)
    cfg = _checked_config(args)  # the prune target is checked once the model's shape is known
    if args.pretrained.startswith("hf:") and Path(args.pretrained[3:]).expanduser().is_dir():
        from cpuforge.tasks.release.lineage import check_hf_checkpoint

        check_hf_checkpoint(Path(args.pretrained[3:]).expanduser(), args.pretrained)  # in a second, before Prefect starts
    from cpuforge.flows.compress import compress

    return _run_flow(compress, pretrained=args.pretrained, profile=cfg.profile, config_file=args.config or "",
                     overrides=args.overrides, workdir=workdir, summary_path=args.summary or "", rebuild=args.rebuild)


def _checked_config(args: argparse.Namespace):
    from cpuforge.tasks.config.settings import load_config
    from cpuforge.tasks.data.corpus import stage_extra_key

    cfg = load_config(args.profile, args.config, args.overrides)
    stage_extra_key(cfg)  # resolves the data source: a wrong path fails here, before any work
    return cfg


def _checked_outputs(args: argparse.Namespace) -> str:
    """Check where the run will write before any work: a bad path fails now, not after the training.
    Returns the workdir, created and resolved."""
    if not args.workdir.strip():
        raise UserError("--workdir is empty: give the folder for the run's outputs")
    workdir = Path(args.workdir).expanduser().resolve()
    if workdir.exists() and not workdir.is_dir():
        raise UserError(f"--workdir {workdir} is a file, not a folder: give a folder (it is created if missing)")
    _writable_folder(workdir, f"--workdir {workdir}")
    if args.summary is not None:
        if not args.summary.strip():
            raise UserError("--summary is empty: give a file path such as summary.json, or leave it out")
        summary = Path(args.summary).expanduser().resolve()
        if summary.is_dir():
            raise UserError(f"--summary {summary} is a folder: give a file path such as {summary / 'summary.json'}")
        _writable_folder(summary.parent, f"--summary {summary}")
    return str(workdir)


def _writable_folder(folder: Path, flag: str) -> None:
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


def _run_flow(flow_fn, **params: Any) -> int:
    global _reaper
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
    _print_summary(summary)
    return 0


def _check_prune_target(cfg) -> None:
    """Reject an impossible pruning target now, estimating the vocabulary by tokenizer.vocab_size."""
    from cpuforge.tasks.stages.prune import target_config

    if cfg.model.unresolved:  # model.size=auto: the shape is chosen when the run starts; prune checks it then
        return
    target_config(cfg.model.shape(cfg.tokenizer.vocab_size), cfg.prune)


def _print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"cpuforge run {summary['run_id']} ({summary['profile']})")
    for column in ("stage", "status", "seconds", "headline metrics", "output"):
        table.add_column(column, overflow="fold")
    for stage, entry in summary["stages"].items():
        metrics = ", ".join(f"{k}={_fmt(v)}" for k, v in list(entry.get("metrics", {}).items())[:8])
        table.add_row(stage, entry["status"], _fmt(entry.get("seconds", 0)), metrics, entry.get("output_dir", ""))
    console = Console() if sys.stdout.isatty() else Console(width=160)
    console.print(table)
    registry = summary.get("registry")
    if registry:
        console.print(f"registry: {registry['model_uri']} (aliases: {', '.join(registry['aliases']) or 'none'}) "
                      f"{registry['decision']}: {registry['reason']}")
        uri = summary.get("mlflow_tracking_uri") or ""
        default = f"sqlite:///{(Path('cpuforge-runs') / 'mlflow.db').resolve()}"
        store = "" if uri == default else f" --tracking-uri {uri}"
        console.print(f"try it: cpuforge generate --model {registry['champion_uri']}{store} --prompt 'def '")
        if registry.get("serve"):
            console.print(f"serve it: MLFLOW_TRACKING_URI={uri} {registry['serve']} --port 5001")
    console.print(f"summary: {Path(summary['run_dir']) / 'summary.json'}")
    uri = summary.get("mlflow_tracking_uri") or ""
    if uri.startswith("sqlite:"):
        console.print(f"MLflow UI: mlflow ui --backend-store-uri {uri}  (then open http://127.0.0.1:5000)")
    else:
        console.print(f"MLflow: {uri} (parent run {summary['mlflow_run_id']})")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return json.dumps(value) if not isinstance(value, str) else value


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


if __name__ == "__main__":
    sys.exit(main())
