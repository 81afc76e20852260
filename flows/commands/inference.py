"""`cpuforge generate` and `cpuforge evaluate`: use any model cpuforge made."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

from cpuforge.flows.commands.common import add_command
from cpuforge.tasks.records.errors import UserError


def model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="PATH_OR_URI",
                   help="a model folder (PyTorch), an .onnx file, a stage output folder, or an MLflow "
                        "URI such as models:/cpuforge-lm@champion")
    p.add_argument("--tracking-uri", help="MLflow store for models:/ URIs (default: $MLFLOW_TRACKING_URI, "
                                          "else the store in ./cpuforge-runs)")


def add_generate(sub: argparse._SubParsersAction) -> None:
    gen = add_command(sub, "generate", "stream text from a model",
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
    gen.set_defaults(handler=generate)


def add_evaluate(sub: argparse._SubParsersAction) -> None:
    ev = add_command(sub, "evaluate", "bits per byte and perplexity of a model on a text file",
                     "Bits per byte do not depend on the tokenizer, so models with different vocabularies compare fairly.",
                     ("cpuforge evaluate --model models:/cpuforge-lm@champion --text notes.txt",
                      "cpuforge evaluate --model cpuforge-runs/stages/recover-KEY --text notes.txt --json"))
    model_args(ev)
    ev.add_argument("--text", required=True, help="a UTF-8 text file, read with the model's own tokenizer")
    ev.add_argument("--json", action="store_true", help="print the result as JSON")
    ev.set_defaults(handler=evaluate)


def model_tracking_uri(args: argparse.Namespace) -> str | None:
    if args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"):
        return args.tracking_uri or os.environ["MLFLOW_TRACKING_URI"]
    default = Path("cpuforge-runs") / "mlflow.db"
    if args.model.startswith(("models:/", "runs:/")) and not default.is_file():
        raise UserError(f"{args.model} needs an MLflow store: pass --tracking-uri (no {default} here)")
    return f"sqlite:///{default.resolve()}"


def generate(args: argparse.Namespace) -> int:
    if args.max_new_tokens <= 0:
        raise UserError("--max-new-tokens must be positive")
    if args.top_k < 0:
        raise UserError(f"--top-k {args.top_k}: must be 0 (no top-k filtering) or a positive number of tokens")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UserError(f"--temperature {args.temperature}: must be 0 (greedy) or a positive number")
    check_utf8("--prompt", args.prompt)
    from cpuforge.models.runtime import check_prompt
    from cpuforge.tasks.release.register import open_model

    lm = open_model(args.model, model_tracking_uri(args))
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


def check_utf8(flag: str, value: str) -> None:
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


def evaluate(args: argparse.Namespace) -> int:
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

    lm = open_model(args.model, model_tracking_uri(args))
    score = score_text(lm, text)
    result = {"model": args.model, "format": lm.kind, "params": lm.params, "text": str(path), **score.as_dict()}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{args.model} ({lm.kind}, {lm.params:,} params) on {path.name}: "
              f"{score.val_bpb:.4f} bits per byte, perplexity {score.ppl:.2f} "
              f"({score.tokens:,} tokens, {score.bytes:,} bytes)")
    return 0
