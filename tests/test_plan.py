"""The stage registry and what it keys: every setting re-keys exactly the stages that declare its
section and the stages after them, and `cpuforge plan` says which and why without running."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from pydantic import ValidationError

from cpuforge.flows.plan import plan
from cpuforge.tasks import stages
from cpuforge.tasks.config.resolve import ResolvedRun
from cpuforge.tasks.config.settings import SECTIONS, load_config
from cpuforge.tasks.infra.stage import NOT_IN_KEY

ORDER = stages.names()


def downstream(names: set[str]) -> set[str]:
    """The stages given and every stage whose inputs lead back to one of them."""
    found = set(names)
    for spec in stages.PIPELINE:
        if found & set(spec.needs):
            found.add(spec.name)
    return found


def candidates(value, annotation):
    """A few other values of this type to try (the first the section accepts is used)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return [a for a in args if a != value]
    if value is None:
        inner = next((a for a in args if a is not type(None)), str)
        if typing.get_origin(inner) is typing.Annotated:  # e.g. NonBlank = Annotated[str, ...]
            inner = typing.get_args(inner)[0]
        return {int: [7, 100], float: [0.5, 3.0]}.get(inner, ["x"])
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value * 2, value - 1, 1, 2]
    if isinstance(value, float):
        return [value * 0.5, value * 2, 0.3, value + 1]
    if isinstance(value, tuple):
        return [tuple(v * 0.9 for v in value)]
    if isinstance(value, list):
        if not value:  # an empty list (eval.prompts' default): one item of either kind
            return [["x"], [1]]
        return [value[:1] if len(value) > 1 else [*value, *value]]
    if isinstance(value, str):
        return [value + "x"]
    return []


def keys(cfg, workdir: Path) -> dict[str, str]:
    return {row.stage: row.key for row in plan(ResolvedRun(cfg, workdir))}


def test_every_setting_rekeys_the_stages_that_declare_it_and_those_after_them(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text\n" * 50)
    other = tmp_path / "other"
    other.mkdir()
    (other / "b.txt").write_text("other text\n" * 50)
    base = load_config("tiny", overrides=[f"data.source={corpus}"])
    base_keys = keys(base, tmp_path / "work")
    tried = 0
    for section_name, section_type in SECTIONS.items():
        section = getattr(base, section_name)
        for field_name, info in section_type.model_fields.items():
            value = getattr(section, field_name)
            options = ([str(other)] if (section_name, field_name) == ("data", "source")
                       else [30.0] if (section_name, field_name) == ("budget", "minutes")  # time to train in
                       else candidates(value, info.annotation))
            changed_cfg = None
            for option in options:
                try:
                    new_section = section_type.model_validate({**section.model_dump(), field_name: option})
                except ValidationError:
                    continue
                changed_cfg = base.model_copy(update={section_name: new_section})
                break
            if changed_cfg is None:
                continue
            if (section_name, field_name) == ("tokenizer", "path"):
                continue  # names a file whose hash is the key: covered in test_tokenize
            tried += 1
            new_keys = keys(changed_cfg, tmp_path / "work")
            rekeyed = {s for s in ORDER if new_keys[s] != base_keys[s]}
            declared = {spec.name for spec in stages.PIPELINE if section_name in spec.sections}
            expected = set() if field_name in NOT_IN_KEY.get(section_name, ()) else downstream(declared)
            if section_name == "budget":  # no stage reads it: it plans train's and recover's minutes (test_budget)
                expected = downstream({"pretrain", "recover"}) if changed_cfg.budget.minutes else set()
            assert rekeyed == expected, f"{section_name}.{field_name}: {sorted(rekeyed)} != {sorted(expected)}"
    assert tried >= 70, tried  # nearly every setting was changed and checked


def test_the_stage_modules_take_their_declarations_from_the_registry():
    import importlib

    # every module in the stages folder (test_layout: nothing else stands there) declares one registered stage
    folder = Path(stages.__file__).parent
    modules = [importlib.import_module(f"{stages.__name__}.{path.stem}") for path in sorted(folder.glob("*.py"))
               if path.stem != "__init__"]
    assert {m.SPEC.name: m.SPEC for m in modules} == stages.BY_NAME
    assert all(m.__name__ == m.SPEC.module for m in modules)
    for spec in stages.PIPELINE:  # every input comes from a stage before it
        assert set(spec.needs) <= set(ORDER[:ORDER.index(spec.name)])


def test_a_stage_sees_only_the_config_sections_it_declares():
    """work(run, <sections>) takes exactly the sections in its key, by name: it cannot read another."""
    import importlib
    import inspect

    for spec in stages.BY_NAME.values():
        work = importlib.import_module(spec.module).work
        params = list(inspect.signature(work).parameters)
        assert params == ["run", *spec.sections], f"{spec.name}: work{tuple(params)} vs sections {spec.sections}"


def test_evaluate_measures_every_variant_the_registry_declares():
    from cpuforge.tasks.infra.store import StageRecord
    from cpuforge.tasks.stages.evaluate import variant_paths

    records = {name: StageRecord(stage=name, key=name, output_dir=f"/out/{name}", files={"model": "m", "onnx": "x.onnx"})
               for name in stages.EVALUATE.needs}
    paths = variant_paths(records)
    assert list(paths) == [spec.evaluates[0] for spec in stages.PIPELINE if spec.evaluates]
    assert str(paths["onnx-int8"]) == "/out/quantize/x.onnx" and stages.FINAL_VARIANT == "onnx-int8"


def test_report_settings_do_not_retrain_a_model(tmp_path):
    """Samples from fixed prompts are evaluate's: new prompts re-key evaluate alone."""
    base = load_config("tiny")
    changed = load_config("tiny", overrides=['eval.prompts=["while "]', "eval.max_new_tokens=5"])
    before, after = keys(base, tmp_path), keys(changed, tmp_path)
    assert {s for s in ORDER if before[s] != after[s]} == {"evaluate"}


def test_rebuild_names_a_stage_and_everything_that_reads_it():
    assert stages.from_stage("recover") == {"recover", "export", "quantize", "evaluate", "gguf"}
    assert stages.from_stage("quantize") == {"quantize", "evaluate"}  # gguf reads recover's model only
    assert stages.from_stage("adopt", stages.COMPRESS) == set(stages.names(stages.COMPRESS)[1:])
    with pytest.raises(ValueError, match="unknown stage 'pretrian'"):
        stages.from_stage("pretrian")


def test_the_docs_list_the_stages_of_the_registry():
    page = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    listed = page.split("<!-- stages:begin -->\n")[1].split("<!-- stages:end -->")[0]
    assert listed == stages.markdown_table(), "regenerate with: python docs/diagram.py"


def _diagram():
    import importlib.util

    path = Path(__file__).parents[1] / "docs" / "diagram.py"
    spec = importlib.util.spec_from_file_location("cpuforge_docs_diagram", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_pipeline_picture_is_drawn_from_the_registry():
    """README's picture (docs/images/pipeline.svg) carries the digest of the registry it was drawn from, and is
    exactly what docs/diagram.py draws now: a stage, input or output added without redrawing fails here."""
    diagram = _diagram()
    picture = diagram.OUT.read_text()
    assert f"from the stage registry {diagram.registry_digest()} " in picture, \
        "the picture is older than the registry; redraw with: python docs/diagram.py"
    assert picture == diagram.draw(), "the picture is not what docs/diagram.py draws; redraw with: python docs/diagram.py"
    page = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    assert diagram.architecture_page(page) == page, "regenerate with: python docs/diagram.py"


def test_a_new_stage_makes_the_picture_stale(monkeypatch):
    import dataclasses

    diagram = _diagram()
    before, drawn = diagram.registry_digest(), diagram.draw()
    extra = dataclasses.replace(stages.GGUF, name="gguf2", needs=("tokenize", "gguf"))
    monkeypatch.setattr(stages, "PIPELINE", (*stages.PIPELINE, extra))
    monkeypatch.setattr(stages, "BY_NAME", {**stages.BY_NAME, "gguf2": extra})
    assert diagram.registry_digest() != before and diagram.draw() != drawn and ">gguf2</text>" in diagram.draw()
