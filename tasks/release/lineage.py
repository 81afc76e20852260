"""Where pretrained weights come from when a run does not start from scratch.

A recurring run continues pretraining from the champion (``train.init_from=champion``), and
the compression flow starts from an existing pretrained model. Both name a *source*: a model
folder, an MLflow run's ``model`` artifact (``runs:/RUN_ID/model``), or ``champion``; the
compression flow also takes ``hf:DIR_OR_ID``, a transformers Llama checkpoint with its own
tokenizer (a folder, or a Hub id fetched with huggingface_hub). The
champion itself is an int8 ONNX file that cannot be trained further, so every registered
version carries lineage tags pointing at the run that holds its fp32 pretrained weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from cpuforge.models.checkpoint import CheckpointError, read_config
from cpuforge.models.fileio import sha256_file
from cpuforge.tasks.config.settings import Config, ModelConfig
from cpuforge.tasks.data.corpus import hub_revision, source_fingerprint
from cpuforge.tasks.infra import confinement, model_registry, tracking
from cpuforge.tasks.infra.stage import NOT_IN_KEY, SERVICE_RETRIES
from cpuforge.tasks.records.errors import ConfigError, ModelError

log = logging.getLogger("cpuforge.lineage")

CHAMPION = "champion"
HF_PREFIX = "hf:"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")
# Version tags written at registration (see lineage_tags).
TAG_PRETRAIN_RUN = "cpuforge.pretrain_run_id"  # run whose artifact "model" holds the fp32 pretrained weights
TAG_DATA_ID = "cpuforge.data_id"  # the data the version was trained on (source fingerprint + data settings)
TAG_DATA_REVISION = "cpuforge.data_revision"  # the hub dataset's commit it was trained on ("" = not a hub dataset)
TAG_INIT_RUN = "cpuforge.init_run_id"  # the run whose weights its pretraining started from ("" = scratch)
TAG_INIT_SHA = "cpuforge.init_sha256"


@dataclass(frozen=True)
class PretrainedSource:
    """Pretrained weights on local disk, ready to load, and where they came from."""

    folder: str  # holds config.json, model.safetensors, tokenizer.json
    sha256: str  # of model.safetensors: names the weights in stage keys
    origin: str  # what was asked for and what it resolved to, for logs and the summary
    run_id: str | None = None  # the MLflow run holding them as artifact "model", when known
    eod_token: str | None = None  # the model's own end-of-document (eos) token; None: the config's

    @property
    def tokenizer_path(self) -> str:
        return str(Path(self.folder) / "tokenizer.json")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def data_identity(cfg: Config) -> str:
    """Names the training data: the source's fingerprint and the settings that read it."""
    h = hashlib.sha256(source_fingerprint(cfg.data).encode())
    h.update(json.dumps(cfg.data.model_dump(mode="json", exclude=set(NOT_IN_KEY["data"])), sort_keys=True).encode())
    return h.hexdigest()


def resolve_init(cfg: Config, workdir: Path) -> PretrainedSource | None:
    """The weights pretraining starts from (``train.init_from``), or None for a fresh model.

    With ``champion``: none while there is no champion. When the champion was itself trained on
    exactly this data, there is nothing new to learn from it: the run starts where the champion's
    own pretraining started, so every stage key matches the champion's run and is reused.
    """
    spec = cfg.train.init_from
    if not spec:
        return None
    if cfg.tokenizer.path:
        raise ConfigError("train.init_from brings its own tokenizer: leave tokenizer.path unset")
    if spec != CHAMPION:
        return resolve_source(spec, cfg, workdir)
    version = champion_version(cfg)
    if version is None:
        log.info("train.init_from=champion: there is no champion yet; pretraining from scratch")
        return None
    tags = version.tags
    label = f"{cfg.tracking.registered_model} v{version.version}"
    if tags.get(TAG_DATA_ID) == data_identity(cfg):
        init_run = tags.get(TAG_INIT_RUN)
        log.info("the champion (%s) was trained on exactly this data: starting where it started (%s), "
                 "so its stages are reused", label, f"run {init_run}" if init_run else "from scratch")
        return _from_run(init_run, workdir, f"champion {label} (same data: its own starting point)") if init_run else None
    if not tags.get(TAG_PRETRAIN_RUN):  # registered before versions carried lineage: nothing to continue from
        log.warning("the champion (%s) has no %s tag, so its pretrained weights cannot be found; pretraining "
                    "from scratch (the result still has to beat it to be promoted)", label, TAG_PRETRAIN_RUN)
        return None
    return _from_run(tags[TAG_PRETRAIN_RUN], workdir, f"champion {label}")


def resolve_source(spec: str, cfg: Config, workdir: Path) -> PretrainedSource:
    """A pretrained model named by the user: ``champion``, ``runs:/RUN_ID/model`` or a folder."""
    if spec == CHAMPION:
        version = champion_version(cfg)
        if version is None:
            raise ConfigError(f"there is no champion of {cfg.tracking.registered_model} yet in "
                              f"{tracking.tracking_uri(cfg, workdir)}: run the pipeline first, or name a model folder")
        label = f"{cfg.tracking.registered_model} v{version.version}"
        return _from_run(_pretrain_run(version, label), workdir, f"champion {label}")
    if spec.startswith("runs:/"):
        run_id, _, path = spec.removeprefix("runs:/").partition("/")
        if path.strip("/") not in ("", "model"):
            raise ConfigError(f"{spec}: expected runs:/RUN_ID/model (a pretrain stage run's model artifact)")
        return _from_run(run_id, workdir, spec)
    if spec.startswith(HF_PREFIX):
        return _from_hf(spec.removeprefix(HF_PREFIX), workdir, spec)
    return _from_folder(confinement.confined("pretrained model folder", spec), spec)


def champion_version(cfg: Config):
    """The registered champion's model version (with its tags), or None."""
    return model_registry.version_by_alias(cfg.tracking.registered_model, CHAMPION)


def lineage_tags(cfg: Config, pretrained_run_id: str | None, init: PretrainedSource | None) -> dict[str, str]:
    """The version tags that let a later run continue from, or recompress, this model."""
    return {TAG_PRETRAIN_RUN: pretrained_run_id or "", TAG_DATA_ID: data_identity(cfg),
            TAG_DATA_REVISION: hub_revision(cfg.data) or cfg.data.hf_revision or "",
            TAG_INIT_RUN: (init.run_id or "") if init else "", TAG_INIT_SHA: init.sha256 if init else ""}


def _pretrain_run(version, label: str) -> str:
    run_id = version.tags.get(TAG_PRETRAIN_RUN)
    if not run_id:
        raise ModelError(f"{label} has no {TAG_PRETRAIN_RUN} tag (registered before cpuforge recorded lineage): "
                         "name its pretrained model folder instead")
    return run_id


def _from_run(run_id: str, workdir: Path, origin: str) -> PretrainedSource:
    """Download a run's ``model`` artifact once into the workdir's cache."""
    folder = Path(workdir) / "cache" / "pretrained" / run_id / "model"
    if not folder.is_dir():
        partial = folder.parent.with_name(run_id + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            tracking.download(f"runs:/{run_id}/model", partial)
        except ModelError:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        os.replace(partial, folder.parent)
    source = _from_folder(folder, origin)
    return PretrainedSource(source.folder, source.sha256, f"{origin} (run {run_id})", run_id)


def _from_hf(name: str, workdir: Path, origin: str) -> PretrainedSource:
    """A transformers checkpoint: a local folder, else a Hub id downloaded once into the workdir's cache."""
    if not name:
        raise ConfigError("hf: needs a folder or a Hugging Face Hub model id, e.g. hf:HuggingFaceTB/SmolLM2-135M")
    local = Path(name).expanduser()
    if local.is_dir():
        folder = confinement.confined("pretrained model folder", local)
    else:
        from huggingface_hub import snapshot_download

        try:  # only what the model needs: no other weight formats, no training states
            folder = Path(snapshot_download(name, cache_dir=Path(workdir) / "cache" / "hf", allow_patterns=[
                "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]))
        except Exception as exc:  # huggingface_hub raises many kinds: offline, unknown repo, gated
            raise ModelError(f"{origin}: not a local folder, and the Hub download failed: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    eod_token = check_hf_checkpoint(folder, origin)
    return PretrainedSource(str(folder.resolve()), sha256_file(folder / "model.safetensors"), origin, eod_token=eod_token)


def check_hf_checkpoint(folder: Path, origin: str) -> str:
    """ModelError (one line) naming what cpuforge cannot take from a transformers checkpoint; else its eos
    token, spelled as its tokenizer spells it: cpuforge's end-of-document token."""
    if not (folder / "config.json").is_file():
        raise ModelError(f"{origin}: {folder} has no config.json (not a transformers checkpoint)")
    try:
        read_config(folder)
    except CheckpointError as exc:
        raise ModelError(f"{origin}: {str(exc).removeprefix(f'{folder}: ')}") from None
    if not (folder / "model.safetensors").is_file():
        found = "sharded safetensors" if (folder / "model.safetensors.index.json").is_file() else "no model.safetensors"
        raise ModelError(f"{origin}: unsupported model: {found} (one model.safetensors file is supported)")
    if not (folder / "tokenizer.json").is_file():
        raise ModelError(f"{origin}: unsupported model: no tokenizer.json (a fast tokenizer's file is needed; "
                         "save the tokenizer with transformers' save_pretrained)")
    config = json.loads((folder / "config.json").read_text())
    eos = config.get("eos_token_id")
    if eos is None and (folder / "generation_config.json").is_file():
        eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if eos is None:
        raise ModelError(f"{origin}: unsupported model: no eos_token_id in config.json or generation_config.json "
                         "(cpuforge ends every document with it)")
    from tokenizers import Tokenizer

    token = Tokenizer.from_file(str(folder / "tokenizer.json")).id_to_token(int(eos))
    if token is None:
        raise ModelError(f"{origin}: eos_token_id={eos} is not in its tokenizer.json")
    return token


def _from_folder(path: Path, origin: str) -> PretrainedSource:
    folder = path / "model" if (path / "model" / "model.safetensors").is_file() else path  # a pretrain stage folder
    missing = [name for name in MODEL_FILES if not (folder / name).is_file()]
    if missing:
        raise ConfigError(f"{path} is not a cpuforge model folder: missing {', '.join(missing)} "
                          "(use a pretrain stage's output folder or its model/ folder)")
    try:
        read_config(folder)
    except CheckpointError as exc:
        raise ModelError(str(exc)) from None
    return PretrainedSource(str(folder.resolve()), sha256_file(folder / "model.safetensors"), origin)


def model_section(source: PretrainedSource, size: str) -> ModelConfig:
    """The model section that describes the source's architecture (every field set: the size is only a name)."""
    found = read_config(Path(source.folder))
    if found.head_dim_override is not None:
        raise ConfigError(f"{source.origin} is a pruned model: start from an unpruned pretrained model")
    return ModelConfig(size=size, **{k: v for k, v in found.to_dict().items() if k != "vocab_size"})


def with_source(cfg: Config, source: PretrainedSource, adopt_shape: bool) -> Config:
    """The config a run from ``source`` uses: its tokenizer; its shape (adopted, or checked against model.*)."""
    shape = model_section(source, cfg.model.size)
    # model.size=auto has nothing to choose when weights exist: they fix the shape (fields set by hand must match).
    auto = cfg.model.unresolved
    differs = [k for k in type(shape).model_fields
               if getattr(cfg.model, k) != getattr(shape, k) and not (auto and getattr(cfg.model, k) is None)]
    if not adopt_shape and differs:
        diff = ", ".join(f"{k}: config {getattr(cfg.model, k)} vs weights {getattr(shape, k)}" for k in differs)
        raise ConfigError(f"train.init_from={cfg.train.init_from}: the weights ({source.origin}) have another shape "
                          f"({diff}); set model.* to match, or clear train.init_from to start from scratch")
    tokenizer = {"path": source.tokenizer_path, **({"eod_token": source.eod_token} if source.eod_token else {})}
    update: dict[str, Any] = {"tokenizer": cfg.tokenizer.model_copy(update=tokenizer)}
    if adopt_shape or auto:
        if source.origin.startswith(HF_PREFIX):  # contexts of thousands of tokens: train and score at the profile's
            shape = shape.model_copy(update={"block_size": min(shape.block_size, cfg.model.block_size)})
        update["model"] = shape
    return cfg.model_copy(update=update)


@task(name="find-pretrained", cache_policy=NO_CACHE, **SERVICE_RETRIES)
def find_init_task(cfg: Config, workdir: Path) -> PretrainedSource | None:
    """The weights pretraining continues from (``train.init_from``), or None for a fresh model."""
    source = resolve_init(cfg, workdir)
    log.info("pretraining starts from %s", source.origin if source else "scratch (a new model)")
    return source


@task(name="find-pretrained", cache_policy=NO_CACHE, **SERVICE_RETRIES)
def find_source_task(spec: str, cfg: Config, workdir: Path) -> PretrainedSource:
    """The pretrained model the compression flow starts from."""
    source = resolve_source(spec, cfg, workdir)
    log.info("compressing %s", source.origin)
    return source
