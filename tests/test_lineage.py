"""Where pretrained weights come from: folders, the champion's lineage, and what is refused."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cpuforge.models.checkpoint import save_model
from cpuforge.models.llama import Llama
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.infra import tracking
from cpuforge.tasks.records.errors import ConfigError, ModelError
from cpuforge.tasks.release.lineage import (
    TAG_PRETRAIN_RUN,
    data_identity,
    resolve_init,
    resolve_source,
    with_source,
)


def model_folder(path, **dims):
    cfg = load_config("tiny")
    llama = replace(cfg.model.shape(512), **dims)
    save_model(Llama(llama), path)
    (path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
    return cfg


def test_a_model_folder_or_its_stage_folder_is_a_source_and_a_wrong_one_says_what_is_missing(tmp_path):
    cfg = model_folder(tmp_path / "stage" / "model")
    by_stage = resolve_source(str(tmp_path / "stage"), cfg, tmp_path)
    by_model = resolve_source(str(tmp_path / "stage" / "model"), cfg, tmp_path)
    assert by_stage.folder == by_model.folder and len(by_stage.sha256) == 64
    with pytest.raises(ConfigError, match="missing config.json, model.safetensors, tokenizer.json"):
        resolve_source(str(tmp_path), cfg, tmp_path)


def test_an_hf_source_that_is_neither_a_folder_nor_reachable_on_the_hub_says_so(tmp_path):
    cfg = load_config("tiny")
    with pytest.raises(ConfigError, match="hf: needs a folder or a Hugging Face Hub model id"):
        resolve_source("hf:", cfg, tmp_path)
    # HF_HUB_OFFLINE=1 (tests/conftest.py): the download fails at once, without the network
    with pytest.raises(ModelError, match="hf:nobody/no-such-model: not a local folder, and the Hub download failed"):
        resolve_source("hf:nobody/no-such-model", cfg, tmp_path)
    model_folder(tmp_path / "plain")  # weights without tokenizer files: nothing names the end of a document
    with pytest.raises(ModelError, match="unsupported model: no eos_token_id"):
        resolve_source(f"hf:{tmp_path / 'plain'}", cfg, tmp_path)


def test_continuing_needs_the_same_shape_and_takes_the_weights_tokenizer(tmp_path):
    cfg = model_folder(tmp_path / "m", d_mlp=96)
    source = resolve_source(str(tmp_path / "m"), cfg, tmp_path)
    with pytest.raises(ConfigError, match="d_mlp: config .* vs weights 96"):
        with_source(cfg, source, adopt_shape=False)
    adopted = with_source(cfg, source, adopt_shape=True)  # the compression flow takes the model as it is
    assert adopted.model.d_mlp == 96 and adopted.tokenizer.path == source.tokenizer_path


def test_a_champion_without_lineage_is_not_continued_from_and_data_identity_follows_the_data(tmp_path):
    import mlflow

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text\n")
    cfg = load_config("tiny", overrides=[f"data.source={corpus}", "train.init_from=champion"])
    tracking.setup(cfg, tmp_path / "work")
    assert resolve_init(cfg, tmp_path / "work") is None  # no registered model at all yet

    client = mlflow.MlflowClient()
    client.create_registered_model("cpuforge-lm")
    with mlflow.start_run() as run:
        pass
    version = client.create_model_version("cpuforge-lm", f"runs:/{run.info.run_id}/model", run.info.run_id)
    client.set_registered_model_alias("cpuforge-lm", "champion", version.version)
    assert resolve_init(cfg, tmp_path / "work") is None  # a champion from before lineage tags: from scratch
    with pytest.raises(Exception, match=TAG_PRETRAIN_RUN):
        resolve_source("champion", cfg, tmp_path / "work")  # compressing it cannot fall back

    before = data_identity(cfg)
    (corpus / "b.txt").write_text("more text\n")
    assert data_identity(cfg) != before
