from pathlib import Path

import pytest

from cpuforge.tasks.config.settings import available_profiles, load_config
from cpuforge.tasks.records.errors import ConfigError


def test_profiles_exist_and_demo_is_default():
    assert {"tiny", "demo", "full"} <= set(available_profiles())
    assert load_config().profile == "demo"
    tiny, demo, full = load_config("tiny"), load_config("demo"), load_config("full")
    assert tiny.model.size == "tiny" and not tiny.model.unresolved  # a fixed shape, for tests
    # demo and full choose their shape for their budget on the machine (tests/test_config_size.py)
    assert demo.model.size == full.model.size == "auto"
    assert tiny.train.max_minutes < demo.train.max_minutes < full.train.max_minutes


def test_overrides_are_typed_from_yaml():
    cfg = load_config("tiny", overrides=["train.max_minutes=2.5", "model.tie_embeddings=false",
                                         "data.max_docs=null", "eval.batch_sizes=[1, 4]"])
    assert cfg.train.max_minutes == 2.5
    assert cfg.model.tie_embeddings is False
    assert cfg.data.max_docs is None
    assert cfg.eval.batch_sizes == [1, 4]


def test_config_file_applies_over_profile_and_set_over_file(tmp_path: Path):
    f = tmp_path / "c.yaml"
    f.write_text("profile: tiny\ntokenizer:\n  vocab_size: 777\ntrain:\n  lr: 0.01\n")
    cfg = load_config(config_file=f, overrides=["train.lr=0.002"])
    assert cfg.profile == "tiny"
    assert cfg.tokenizer.vocab_size == 777
    assert cfg.train.lr == 0.002
    assert cfg.model.d_model == load_config("tiny").model.d_model


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["model.n_haed=3"], "unknown key 'model.n_haed' (did you mean model.n_head?)"),
        (["modle.n_head=3"], "unknown section 'modle' (did you mean model?)"),
        (["tokenizer.vocab_size=100"], "use at least 257"),
        (["model.n_head=5"], "model.n_head=5 does not divide model.d_model=64"),
        (["model.n_kv_head=3"], "model.n_kv_head=3 does not divide model.n_head=4"),
        (["prune.keep_ratio=1.5"], "prune.keep_ratio: Input should be less than or equal to 1"),
        (["train.precision=fp8"], "train.precision: Input should be 'auto', 'fp32' or 'bf16'"),
        (["data.val_fraction=0"], "data.val_fraction: Input should be greater than 0"),
        (["train.max_steps=null", "train.max_minutes=null"], "train needs a budget"),
        (["novalue"], "expected section.key=value"),
        (["train.optimizer=muon", "train.strategy=fsdp", "train.nproc_per_node=2"],
         "train.optimizer=muon cannot run with train.strategy=fsdp"),
        (["recover.optimizer=muon", "train.strategy=fsdp", "train.nproc_per_node=2"],
         "recover.optimizer=muon cannot run with train.strategy=fsdp"),
    ],
)
def test_bad_settings_are_rejected_with_a_message_naming_them(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides=overrides)
    assert expected in str(err.value)


def test_unknown_key_lists_what_is_allowed():
    with pytest.raises(ConfigError, match=r"allowed: .*data\.source.*data\.text_field"):
        load_config("tiny", overrides=["data.sourse=x"])


def test_bad_config_files(tmp_path: Path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(config_file=tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(config_file=bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("trian:\n  lr: 1\n")
    with pytest.raises(ConfigError, match="unknown section 'trian' \\(did you mean train\\?\\)"):
        load_config(config_file=typo)
    with pytest.raises(ConfigError, match="unknown profile 'huge'; available: demo, full, hour, overnight, tiny"):
        load_config("huge")


def test_the_flow_forms_blank_fields_keep_the_profile_and_filled_ones_override_it():
    from cpuforge.flows.session import resolve_flow_run

    tiny = load_config("tiny")
    blank = resolve_flow_run("tiny", "", (), data_source="", pretrain_minutes=0, keep_ratio=0, prune_strategy="").cfg
    assert blank == tiny
    cfg = resolve_flow_run("tiny", "", ["prune.keep_ratio=0.7"], data_source="yes", keep_ratio=0.6, prune_strategy="depth",
                           pretrain_minutes=1.5).cfg
    assert cfg.data.source == "yes"  # typed text stays text, not YAML's boolean
    assert cfg.prune.strategy == "depth" and cfg.train.max_minutes == 1.5
    assert cfg.prune.keep_ratio == 0.7  # free-form overrides have the last word


def test_the_default_optimizer_is_muon_except_under_fsdp_where_it_cannot_run():
    assert load_config("tiny").train.optimizer_in_use() == "muon"
    fsdp = load_config("tiny", overrides=["train.strategy=fsdp", "train.nproc_per_node=2"])
    assert fsdp.train.optimizer_in_use() == "adamw"
    assert load_config("tiny", overrides=["train.optimizer=adamw"]).train.optimizer_in_use() == "adamw"


def test_the_demo_recovers_with_muon_except_under_fsdp():
    demo = load_config("demo")
    assert demo.recover.optimizer_in_use(demo.train) == "muon"
    fsdp = load_config("demo", overrides=["train.strategy=fsdp", "train.nproc_per_node=2"])
    assert fsdp.recover.optimizer_in_use(fsdp.train) == "adamw"
    tiny = load_config("tiny")  # a profile that does not set it keeps AdamW
    assert tiny.recover.optimizer_in_use(tiny.train) == "adamw"
