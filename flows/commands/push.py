"""`cpuforge push`: a finished model to the Hugging Face Hub (tasks/release/hub_push.py)."""

from __future__ import annotations

import argparse
import re

from cpuforge.flows.commands.common import add_command, champion_or
from cpuforge.tasks.records.errors import UserError

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


def add_push(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "push", "push a model to the Hugging Face Hub",
                    "One commit with the recovered model in transformers' layout and its model card at the root, "
                    "the Q8_0 and Q4_0 GGUF files beside them, and the quantized ONNX Runtime GenAI folder in onnx/. "
                    "Logs in as huggingface_hub does (`hf auth login`, or $HF_TOKEN). --dry-run lists the files and "
                    "uploads nothing.",
                    ("cpuforge push --repo-id me/cpuforge-demo --dry-run     # the work folder's champion",
                     "cpuforge push --repo-id me/cpuforge-demo --private",
                     "cpuforge push --repo-id me/lm models:/cpuforge-lm/3 --workdir runs/w"))
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="models:/NAME@ALIAS or models:/NAME/VERSION (registered by cpuforge), or a quantize stage "
                        "output folder; default: the work folder's champion")
    p.add_argument("--repo-id", required=True, help="the Hub repository, USER_OR_ORG/NAME (created if missing)")
    p.add_argument("--workdir", help="the work folder that made the model (default: cpuforge-runs)")
    p.add_argument("--tracking-uri", help="MLflow store for models:/ URIs (default: $MLFLOW_TRACKING_URI, else the "
                                          "work folder's)")
    p.add_argument("--registered-model", default="cpuforge-lm",
                   help="the registry name whose champion is pushed when MODEL is left out")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--dry-run", action="store_true", help="list what would be uploaded, and upload nothing")
    p.set_defaults(handler=push)


def push(args: argparse.Namespace) -> int:
    if not REPO_ID.fullmatch(args.repo_id):
        raise UserError(f"--repo-id {args.repo_id!r}: expected USER_OR_ORG/NAME (letters, digits, '-', '_', '.')")
    from cpuforge.tasks.release import hub_push

    model, tracking_uri, workdir = champion_or(args.model, args.workdir, args.tracking_uri, args.registered_model)
    found = hub_push.find_stages(model, workdir, tracking_uri)
    uploads = hub_push.plan(found, args.repo_id)
    total = sum(u.size for u in uploads)
    for u in uploads:
        print(f"{u.size / 1e6:>10,.2f} MB  {u.path_in_repo}")
    print(f"{total / 1e6:>10,.2f} MB  in {len(uploads)} files, from {found.quantize.output_dir}"
          f"{'' if found.gguf else ' (no gguf stage output for this model: no GGUF files)'}")
    if args.dry_run:
        print(f"dry run: nothing uploaded to https://huggingface.co/{args.repo_id}")
        return 0
    url = hub_push.push(args.repo_id, uploads, args.private, f"cpuforge: {model}")
    print(f"pushed to https://huggingface.co/{args.repo_id} ({url})")
    return 0
