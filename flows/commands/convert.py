"""`cpuforge export` and `cpuforge quantize`: one stage on a model of one's own, without the pipeline."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from cpuforge.flows.commands.common import add_command, positive_seconds
from cpuforge.tasks.records.errors import UserError


def add_export(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "export", "export a model folder to ONNX, proven against PyTorch",
                    "A transformers Llama folder (config.json, model.safetensors, tokenizer.json) or a cpuforge model "
                    "or stage folder becomes one ONNX decoder with a KV cache and the ONNX Runtime GenAI files beside "
                    "it. The export fails unless its logits match PyTorch's and its greedy generations match token for "
                    "token, on windows of --text (random token ids without it).",
                    ("cpuforge export ./SmolLM2-135M --out smollm-onnx --context 2048",
                     "cpuforge export cpuforge-runs/stages/recover-KEY --text notes.txt --json"))
    p.add_argument("model", metavar="MODEL_DIR", help="the model folder")
    p.add_argument("--out", help="the folder to write (default: ./NAME-onnx); it must not hold files yet")
    p.add_argument("--text", help="a UTF-8 text file whose windows prove the graph")
    p.add_argument("--context", type=int, help="positions the exported model takes (default: the model's own; a "
                                               "Hub model's 8k context makes every later check slower)")
    p.add_argument("--opset", type=int, help="ONNX opset (default: the export section's, `cpuforge config --explain`)")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.set_defaults(handler=export)


def add_quantize(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "quantize", "quantize an ONNX model or a model folder to int8/int4, the fastest good one kept",
                    "The quantize stage on a model of one's own: each candidate (onnxruntime's dynamic and static int8, "
                    "ONNX Runtime GenAI's builder at int8 and int4 where a model folder is given) is scored on --text "
                    "(bits per byte, agreement with fp32), timed against fp32 in alternation, and the quantize "
                    "section's rule keeps one as OUT/model.int8.onnx with the GenAI files beside it. A model folder is "
                    "exported first (into OUT/export).",
                    ("cpuforge quantize ./SmolLM2-135M --text notes.txt --context 1024",
                     "cpuforge quantize smollm-onnx --text notes.txt --method dynamic --out smollm-int8",
                     "cpuforge quantize ./SmolLM2-135M --text notes.txt --build-seconds 300 --speed-seconds 120"))
    p.add_argument("model", metavar="ONNX_OR_MODEL_DIR",
                   help="a model.onnx that `cpuforge export` (or the export stage) wrote, its folder, or a model folder")
    p.add_argument("--text", required=True, help="a UTF-8 text file to score and calibrate on")
    p.add_argument("--out", help="the folder to write (default: ./NAME-quantized); it must not hold files yet")
    p.add_argument("--context", type=int, help="positions the model takes, for a model folder (default: its own)")
    p.add_argument("--method", choices=("best", "dynamic", "static", "genai"), default="best",
                   help="which candidates to try (quantize.method)")
    p.add_argument("--favour", choices=("balanced", "decode", "prefill"), default="balanced",
                   help="what the kept candidate is fastest at (quantize.favour)")
    p.add_argument("--build-seconds", type=positive_seconds, metavar="S",
                   help="stop building candidates (likeliest winners first) once another would end past S seconds "
                        "(quantize.build_seconds; default: build every candidate)")
    p.add_argument("--speed-seconds", type=positive_seconds, metavar="S",
                   help="cap the timing rounds at S seconds (quantize.speed_seconds; default: until settled)")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.set_defaults(handler=quantize)


def _out_dir(given: str | None, model: Path, suffix: str) -> Path:
    name = model.parent.name if model.suffix == ".onnx" else model.name
    out = Path(given).expanduser() if given else Path.cwd() / f"{name}-{suffix}"
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out}: already holds files; choose another folder or empty it")
    return out


def _paths(args: argparse.Namespace, suffix: str) -> tuple[Path, Path, Path | None]:
    model = Path(args.model).expanduser()
    if not model.exists():
        raise UserError(f"{model}: no such file or folder")
    if args.context is not None and args.context < 2:
        raise UserError(f"--context {args.context}: must be at least 2 positions")
    text = Path(args.text).expanduser() if args.text else None
    if text is not None and not text.is_file():
        raise UserError(f"--text {text}: no such file")
    return model, _out_dir(args.out, model, suffix), text


def _report(args: argparse.Namespace, what: str, out: Path, metrics: dict) -> None:
    if args.json:
        print(json.dumps({"out": str(out), **metrics}, indent=2))
    else:
        print(f"{what} in {out}")


def export(args: argparse.Namespace) -> int:
    model, out, text = _paths(args, "onnx")
    from cpuforge.tasks.release.convert import export_folder

    with tempfile.TemporaryDirectory(prefix="cpuforge-export-") as work:
        result = export_folder(model, out, text, args.context, args.opset, Path(work))
    m = result.metrics
    _report(args, f"model.onnx ({m['file_bytes'] / 1e6:.1f} MB): logits within {m['parity_max_abs_diff']:.2g} of "
                  f"PyTorch's, greedy generations identical", out, m)
    return 0


def quantize(args: argparse.Namespace) -> int:
    model, out, text = _paths(args, "quantized")
    from cpuforge.tasks.config.settings import QuantizeConfig
    from cpuforge.tasks.release.convert import quantize_path

    with tempfile.TemporaryDirectory(prefix="cpuforge-quantize-") as work:
        settings = QuantizeConfig(method=args.method, favour=args.favour, build_seconds=args.build_seconds,
                                  speed_seconds=args.speed_seconds)
        result = quantize_path(model, out, text, args.context, settings, Path(work))
    _report(args, f"model.int8.onnx, {result.info['kept_is']} ({result.info['rule']})", out, result.metrics)
    return 0
