"""A confined worker (CPUFORGE_ALLOWED_ROOTS set, as deployments/worker.sh does) refuses flow
parameters that name paths outside its folders, symlinks and `..` included, and Dask schedulers
that are not on its allow-list; the local CLI (nothing set) is not confined."""

from __future__ import annotations

import json

import pytest

from cpuforge.flows.session import resolve_flow_run
from cpuforge.tasks.infra import confinement
from cpuforge.tasks.records.errors import ConfigError
from cpuforge.tasks.release.lineage import resolve_source


@pytest.fixture
def roots(tmp_path, monkeypatch):
    inside, outside = tmp_path / "allowed", tmp_path / "elsewhere"
    inside.mkdir()
    outside.mkdir()
    monkeypatch.setenv(confinement.ALLOWED_ROOTS_ENV, f"/nonexistent-root:{inside}")
    monkeypatch.delenv(confinement.DASK_ALLOWED_ENV, raising=False)
    return inside, outside


def test_paths_inside_the_allowed_roots_pass(roots):
    inside, _ = roots
    (inside / "corpus").mkdir()
    (inside / "cfg.yaml").write_text("train:\n  max_minutes: 1\n")
    cfg = resolve_flow_run("tiny", str(inside / "cfg.yaml"), [f"tokenizer.path={inside}/tok.json",
                                                          f"tracking.uri=sqlite:///{inside}/mlflow.db"],
                      data_source=str(inside / "corpus" / "*.txt"), init_from=str(inside / "model")).cfg
    assert cfg.train.max_minutes == 1
    confinement.check_run_paths(str(inside / "work"), str(inside / "work" / "summary.json"))
    # Not paths: the built-in corpus, a hub dataset, the champion, an MLflow run, a tracking server.
    resolve_flow_run("tiny", None, ["tracking.uri=http://10.0.0.1:5000", "train.init_from=runs:/abc/model"],
                data_source="hf:user/dataset")
    resolve_flow_run("tiny", None, [], data_source="stdlib", init_from="champion")


@pytest.mark.parametrize("setting", ["data_source", "init_from", "tokenizer.path", "tracking.uri", "data.source",
                                     "glob", "glob-dotdot"])
def test_a_setting_naming_a_path_outside_is_refused(roots, setting):
    inside, outside = roots
    form, overrides = {}, []
    if setting in ("data_source", "init_from"):
        form[setting] = str(outside)
    elif setting == "glob":
        form["data_source"] = f"{outside}/**/*.txt"
    elif setting == "glob-dotdot":  # the part before the wildcard is inside; the `..` after it leads out
        form["data_source"] = f"{inside}/*/../../elsewhere/*.txt"
    elif setting == "tracking.uri":
        overrides.append(f"tracking.uri=sqlite:///{outside}/mlflow.db")
    else:  # the free-form overrides are checked like the form's fields
        overrides.append(f"{setting}={outside}/x")
    with pytest.raises(ConfigError, match="(outside|leave) the folders this worker allows"):
        resolve_flow_run("tiny", None, overrides, **form)


def test_workdir_summary_and_config_file_outside_are_refused(roots):
    inside, outside = roots
    secret = outside / "secret.yaml"
    secret.write_text("not: [a, config")
    with pytest.raises(ConfigError, match="config_file=.*outside") as err:
        resolve_flow_run("tiny", str(secret), [])
    assert "not: [a" not in str(err.value)  # refused before it is read: nothing of it leaks
    with pytest.raises(ConfigError, match="workdir=.*outside"):
        confinement.check_run_paths(str(outside / "work"), "")
    with pytest.raises(ConfigError, match="summary_path=.*outside"):
        confinement.check_run_paths(str(inside / "work"), str(outside / "summary.json"))


def test_symlinks_and_dotdot_out_of_a_root_are_refused(roots):
    inside, outside = roots
    (inside / "link").symlink_to(outside)
    for path in (inside / "link" / "work", f"{inside}/../elsewhere/work"):
        with pytest.raises(ConfigError, match="outside"):
            confinement.check_run_paths(str(path), "")


def test_a_pretrained_model_folder_outside_is_refused(roots):
    _, outside = roots
    (outside / "config.json").write_text(json.dumps({"model": {}}))
    cfg = resolve_flow_run("tiny", None, []).cfg
    with pytest.raises(ConfigError, match="pretrained model folder=.*outside"):
        resolve_source(str(outside), cfg, outside)


def test_dask_addresses_must_be_on_the_allow_list(roots, monkeypatch):
    with pytest.raises(ConfigError, match="not a Dask scheduler this worker allows .*none"):
        resolve_flow_run("tiny", None, ["data.dask_address=tcp://10.0.0.5:8786"])
    monkeypatch.setenv(confinement.DASK_ALLOWED_ENV, "tcp://10.0.0.5:8786, dask.internal:8786")
    resolve_flow_run("tiny", None, ["data.dask_address=10.0.0.5:8786"])  # the default scheme is the same address
    resolve_flow_run("tiny", None, ["data.dask_address=tcp://dask.internal:8786"])
    with pytest.raises(ConfigError, match="data.dask_address=tcp://evil:8786"):
        resolve_flow_run("tiny", None, ["data.dask_address=tcp://evil:8786"])


def test_an_unconfined_process_takes_any_path_and_scheduler(tmp_path, monkeypatch):
    monkeypatch.delenv(confinement.ALLOWED_ROOTS_ENV, raising=False)
    monkeypatch.delenv(confinement.DASK_ALLOWED_ENV, raising=False)
    resolve_flow_run("tiny", None, ["data.dask_address=tcp://10.0.0.5:8786", "tokenizer.path=/etc/tok.json"],
                data_source="/etc")
    resolve_flow_run("tiny", None, [], data_source="../corpus/*/../*.txt")
    confinement.check_run_paths("/tmp/anywhere", "/tmp/summary.json")
