"""A finished model on the Hugging Face Hub, in the layout the Hub shows and the tools people use read:

- the repository's root is the recovered model in transformers' layout (config.json, model.safetensors, the
  tokenizer files), with a model card that says what every file is and how to run it;
- the GGUF files of the gguf stage (Q8_0 and Q4_0; the Hub lists them as GGUF variants for llama.cpp);
- ``onnx/``: the quantize stage's kept model as an ONNX Runtime GenAI folder (graph, genai_config.json,
  tokenizer).

The files come from the stage outputs in the work folder that made the model: its quantize stage output,
the recover output that stage read and the gguf output made from the same recovered weights. Uploading is
huggingface_hub's: one commit, large files through its LFS/Xet path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cpuforge.models import onnx_files
from cpuforge.tasks.infra import model_registry
from cpuforge.tasks.infra.store import RECORD_FILE, StageRecord, StageStore
from cpuforge.tasks.records.errors import UserError

GGUF_ROLES = ("gguf_q8_0", "gguf_q4_0")  # the f32 file is left out: model.safetensors is the full-precision copy
ONNX_FOLDER = "onnx"


@dataclass(frozen=True)
class Upload:
    path_in_repo: str
    local: Path | None = None  # a file to upload, or
    text: str | None = None  # content made here (the model card)

    @property
    def size(self) -> int:
        return self.local.stat().st_size if self.local is not None else len((self.text or "").encode())


@dataclass
class ModelStages:
    quantize: StageRecord
    recover: StageRecord
    gguf: StageRecord | None


def find_stages(model: str, workdir: Path, tracking_uri: str | None) -> ModelStages:
    """The stage outputs behind ``model``: a models:/NAME@ALIAS or models:/NAME/VERSION URI (the version's
    quantize key, registered by cpuforge) or a quantize stage output folder."""
    store = StageStore(workdir)
    if model.startswith("models:/"):
        name, _, which = model.removeprefix("models:/").replace("@", "/", 1).partition("/")
        version = model_registry.find_version(name, which, tracking_uri) if which else None
        if version is None:
            raise UserError(f"{model}: no such registered version in {tracking_uri}")
        key = version.tags.get(model_registry.TAG_SOURCE_KEY, "")
        quantize = store.lookup("quantize", key) if key else None
        if quantize is None:
            raise UserError(f"{model} (version {version.version}) was made from quantize output {key[:12] or '?'}, "
                            f"which is not in {store.root}: give the --workdir that made it")
    else:
        folder = Path(model).expanduser()
        try:
            quantize = StageRecord.model_validate_json((folder / RECORD_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            quantize = None
        if quantize is None or quantize.stage != "quantize":
            raise UserError(f"{folder}: not a quantize stage output (cpuforge-runs/stages/quantize-KEY); give one, "
                            "or a models:/NAME@ALIAS URI, or nothing for the work folder's champion")
        quantize = quantize.model_copy(update={"output_dir": str(folder)})
    recover_key = quantize.key_parts.get("inputs", {}).get("recover", "")
    recover = store.lookup("recover", recover_key) if recover_key else None
    if recover is None:
        raise UserError(f"the recovered model quantize output {quantize.key[:12]} was made from is not in {store.root}")
    return ModelStages(quantize, recover, _gguf_of(store, recover_key))


def _gguf_of(store: StageStore, recover_key: str) -> StageRecord | None:
    for record_file in sorted(store.root.glob(f"gguf-*/{RECORD_FILE}")):
        try:
            record = StageRecord.model_validate_json(record_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if record.key_parts.get("inputs", {}).get("recover") == recover_key:
            return store.lookup("gguf", record.key)
    return None


def plan(stages: ModelStages, repo_id: str) -> list[Upload]:
    """Every file of the repository, the model card last."""
    model_dir = stages.recover.path("model")
    uploads = [Upload(f.name, f) for f in sorted(model_dir.iterdir()) if f.is_file() and f.name != "README.md"]
    if stages.gguf is not None:
        uploads += [Upload(stages.gguf.files[role], stages.gguf.path(role)) for role in GGUF_ROLES
                    if role in stages.gguf.files]
    onnx_dir = Path(stages.quantize.output_dir)
    graph = stages.quantize.path("onnx")
    onnx = [*onnx_files.files_of(graph), stages.quantize.files["genai_config"], "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]  # those the folder has
    uploads += [Upload(f"{ONNX_FOLDER}/{name}", onnx_dir / name) for name in onnx if (onnx_dir / name).is_file()]
    card = (model_dir / "README.md").read_text(encoding="utf-8") if (model_dir / "README.md").is_file() else ""
    return [*uploads, Upload("README.md", text=hub_card(card, repo_id, uploads, stages))]


def hub_card(card: str, repo_id: str, uploads: list[Upload], stages: ModelStages) -> str:
    """The recovered model's card, pointed at the repository, with what the other files are and what runs them."""
    card = card.replace("tags: [cpuforge, llama]", "tags: [cpuforge, llama, gguf, onnx]").replace('"PATH"',
                                                                                               f'"{repo_id}"')
    mb = {u.path_in_repo: f"{u.size / 1e6:,.1f} MB" for u in uploads}
    rows = [f"| `model.safetensors` ({mb.get('model.safetensors', '?')}), `config.json`, tokenizer files | "
            "fp32 weights in transformers' layout | transformers (above), or any tool that reads it |"]
    for u in uploads:
        if u.path_in_repo.endswith(".gguf"):
            kind = u.path_in_repo.removeprefix("model-").removesuffix(".gguf").upper()
            rows.append(f"| `{u.path_in_repo}` ({mb[u.path_in_repo]}) | GGUF, {kind} | llama.cpp: "
                        f"`hf download {repo_id} {u.path_in_repo} --local-dir .` then "
                        f"`llama-cli -m {u.path_in_repo} -p 'def '` |")
    kept = stages.quantize.info.get("kept_is", stages.quantize.info.get("kept", ""))
    graph = f"{ONNX_FOLDER}/{stages.quantize.files['onnx']}"
    rows.append(f"| `{ONNX_FOLDER}/` ({mb.get(graph, '?')} graph) | {kept or 'the quantized ONNX model'} | ONNX "
                f"Runtime GenAI: `hf download {repo_id} --include '{ONNX_FOLDER}/*' --local-dir .` then "
                f"`og.Model('{ONNX_FOLDER}')` |")
    return card.rstrip() + "\n\n## Files\n\n| file | what it is | what runs it |\n|---|---|---|\n" + "\n".join(rows) + "\n"


def push(repo_id: str, uploads: list[Upload], private: bool, message: str) -> str:
    """Create the repository if needed and upload every file in one commit; the commit's URL."""
    import httpx
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    api = HfApi()
    operations = [CommitOperationAdd(u.path_in_repo, str(u.local) if u.local is not None else u.text.encode())
                  for u in uploads]
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        return api.create_commit(repo_id, operations, commit_message=message, repo_type="model").commit_url
    except LocalTokenNotFoundError:
        raise UserError("not logged in to the Hugging Face Hub: run `hf auth login` or set HF_TOKEN") from None
    except HfHubHTTPError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"the Hub refused the push to {repo_id}: {first}") from None
    except (httpx.HTTPError, OSError) as exc:  # no route to the Hub: DNS, a refused connection, a timeout
        raise UserError(f"cannot reach the Hugging Face Hub to push {repo_id} ({type(exc).__name__}: {exc}); "
                        "check the network, or HF_ENDPOINT") from None
