"""`cpuforge serve`: a model behind the OpenAI API (tasks/release/openai_server.py)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path

from cpuforge.flows.commands.common import add_command, champion_or
from cpuforge.tasks.records.errors import UserError

API_KEY_ENV = "CPUFORGE_API_KEY"


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "serve", "serve a model over the OpenAI API",
                    "/v1/completions, /v1/chat/completions (when the tokenizer has a chat template) and /v1/models, "
                    "streamed by server-sent events when asked; any OpenAI client talks to it "
                    "(base_url http://HOST:PORT/v1). One request decodes at a time; others wait their turn. "
                    f"Beyond loopback it needs an API key (--api-key or ${API_KEY_ENV}), which clients send as "
                    "Authorization: Bearer KEY.",
                    ("cpuforge serve                      # the work folder's champion on http://127.0.0.1:8000/v1",
                     "cpuforge serve models:/cpuforge-lm@champion --port 8080",
                     "cpuforge serve cpuforge-runs/stages/quantize-KEY --served-model-name my-lm",
                     "cpuforge serve --host 0.0.0.0 --port 8000   # with $CPUFORGE_API_KEY set: clients send it"))
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="a model folder, an .onnx file or ONNX Runtime GenAI folder, a stage output, or an MLflow "
                        "URI (models:/NAME@ALIAS, runs:/RUN/model); default: the work folder's champion")
    p.add_argument("--workdir", help="the work folder whose MLflow store holds the champion (default: cpuforge-runs)")
    p.add_argument("--tracking-uri", help="MLflow store or server for models:/ URIs (default: $MLFLOW_TRACKING_URI, "
                                          "else the work folder's)")
    p.add_argument("--registered-model", default="cpuforge-lm",
                   help="the registry name whose champion is served when MODEL is left out")
    p.add_argument("--served-model-name", help="the id clients name in `model` (default: the registered name, or "
                                               "the model folder's or file's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", help=f"the key clients must send (default: ${API_KEY_ENV}); needed beyond loopback")
    p.set_defaults(handler=serve)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def served_name(model: str) -> str:
    if model.startswith("models:/"):
        return model.removeprefix("models:/").split("@")[0].split("/")[0]
    path = Path(model)
    return path.stem if path.suffix == ".onnx" else path.resolve().name


def serve(args: argparse.Namespace) -> int:
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not is_loopback(args.host) and not api_key:
        raise UserError(f"refusing to serve on {args.host} without an API key: pass --api-key or set {API_KEY_ENV} "
                        "(clients send it as Authorization: Bearer KEY), or serve on 127.0.0.1")
    if not 0 < args.port < 65536:
        raise UserError(f"--port {args.port}: must be from 1 to 65535")
    from cpuforge.tasks.release.openai_server import Engine
    from cpuforge.tasks.release.openai_server import serve as run_server
    from cpuforge.tasks.release.register import open_model

    model, tracking_uri, _ = champion_or(args.model, args.workdir, args.tracking_uri, args.registered_model)
    lm = open_model(model, tracking_uri)
    name = args.served_model_name or served_name(model)
    print(f"serving {model} as {name!r} ({lm.kind}, {lm.params:,} parameters, context {lm.cfg.block_size} tokens"
          f"{', chat template' if lm.chat_template else ''}) on http://{args.host}:{args.port}/v1"
          f"{' (API key required)' if api_key else ''}", file=sys.stderr, flush=True)
    run_server(Engine(lm, name), args.host, args.port, api_key)
    return 0
