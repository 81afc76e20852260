"""Stage keys know the code: an edit re-runs the stages whose code or settings' declarations it can change,
and nothing else. Each case edits a copy of the project and keys every stage of the registry with a fresh
interpreter, as a run would."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cpuforge.tasks import stages
from cpuforge.tasks.infra.codehash import module_closure

ROOT = Path(__file__).resolve().parents[1]
ALL = frozenset(stages.BY_NAME)
TRAINING = frozenset(name for name, spec in stages.BY_NAME.items() if spec.kind == "training")


def stage_code_hashes(project: Path) -> dict[str, str]:
    """Each registered stage's code hash (its modules and its sections' declarations), computed by a fresh
    interpreter on this copy of the project (laid out as the installed namespace, first on the path)."""
    script = ("import json; from cpuforge.tasks import stages; from cpuforge.tasks.infra.codehash import code_hash; "
              "print(json.dumps({n: code_hash(s.module, s.sections) for n, s in stages.BY_NAME.items()}))")
    out = subprocess.run([sys.executable, "-c", script], cwd=project, env={"PYTHONPATH": str(project)},
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A copy of the project the cases edit (each restores what it edited)."""
    root = tmp_path_factory.mktemp("project")
    for package in ("flows", "tasks", "models"):
        shutil.copytree(ROOT / package, root / "cpuforge" / package, ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.fixture(scope="module")
def unedited(project) -> dict[str, str]:
    return stage_code_hashes(project)


def rekeyed_by(project: Path, unedited: dict[str, str], file: str, old: str, new: str) -> set[str]:
    """The stages whose key changes when `old` becomes `new` in `file` (restored afterwards)."""
    path = project / "cpuforge" / file
    source = path.read_text()
    assert source.count(old) == 1, f"{old!r} is not once in {file}: the test needs updating"
    path.write_text(source.replace(old, new))
    try:
        after = stage_code_hashes(project)
    finally:
        path.write_text(source)
    return {name for name in ALL if after[name] != unedited[name]}


SETTINGS = "tasks/config/settings.py"
EDITS = {
    # the trainer: the training stages, nothing else
    "trainer": ("tasks/engine/trainer.py", "def lr_at(step: int, s: TrainConfig, horizon: int) -> float:\n",
                "def lr_at(step: int, s: TrainConfig, horizon: int) -> float:\n    step = max(step, 0)\n",
                TRAINING),
    # a help text, in a section tokenize reads: nothing
    "help text": (SETTINGS, 'description="Column holding the text in structured files and hub datasets."',
                  'description="The column that holds the text in structured files and hub datasets."', set()),
    # an error message: nothing
    "error message": (SETTINGS, 'raise ValueError("tokenizer.vocab_size must fit in uint32")',
                      'raise ValueError("tokenizer.vocab_size must fit in 32 bits")', set()),
    # another stage's section (a new setting of recover's): recover only
    "recover's section": (SETTINGS, '    muon_lr: float = Field(2e-3, gt=0, description="Muon\'s peak learning rate when',
                          '    warmup_steps: int = Field(10, ge=0)\n'
                          '    muon_lr: float = Field(2e-3, gt=0, description="Muon\'s peak learning rate when', {"recover"}),
    # a validator of tokenize's own section: tokenize and the stages that read its output
    "tokenizer's validator": (SETTINGS, "smallest = BYTE_ALPHABET + 1", "smallest = BYTE_ALPHABET + 2",
                              {"tokenize"}),
    # the config's loading code runs before any stage: it changes values, which are in the key already
    "config loading": (SETTINGS, "def available_profiles() -> list[str]:\n",
                       "def available_profiles() -> list[str]:\n    assert PROFILES_DIR\n", set()),
    # the registry and the infrastructure run, key and report stages; they compute nothing in them
    "registry": ("tasks/stages/__init__.py", "# The recovered model as GGUF",
                 "# A new stage here.\n# The recovered model as GGUF", set()),
    "tracking": ("tasks/infra/tracking.py", "def log_run_metrics(",
                 "def unused_helper():\n    pass\n\n\ndef log_run_metrics(", set()),
}


@pytest.mark.parametrize("edit", EDITS)
def test_an_edit_rekeys_exactly_the_stages_that_run_it(project, unedited, edit):
    file, old, new, expected = EDITS[edit]
    assert rekeyed_by(project, unedited, file, old, new) == set(expected)


def test_imports_inside_functions_count():
    # step_timing imports the model only inside the function that measures a training step
    assert "cpuforge.models.llama" in module_closure("cpuforge.tasks.engine.step_timing")
    # recover imports the training engine's launcher; the engine's trainer belongs to recover's closure through it
    assert "cpuforge.tasks.engine.trainer" in module_closure("cpuforge.tasks.stages.recover")
    assert "cpuforge.tasks.engine.trainer" in module_closure("cpuforge.tasks.stages.pretrain")
    assert "cpuforge.models.llama" in module_closure("cpuforge.tasks.stages.export")
    assert all(name.split(".")[1] in ("flows", "tasks", "models") for name in module_closure("cpuforge.tasks.stages.evaluate"))


def test_the_training_engine_is_in_the_training_stages_keys_only():
    training_code = {"cpuforge.tasks.engine.trainer", "cpuforge.tasks.engine.training_run",
                     "cpuforge.tasks.engine.step_timing", "cpuforge.tasks.engine.optimizers"}
    for name, spec in stages.BY_NAME.items():
        held = training_code & module_closure(spec.module)
        assert bool(held) == (name in TRAINING), (name, sorted(held))
    # tokenize reads the machine's cores, not the model or the training step
    assert "cpuforge.models.llama" not in module_closure(stages.TOKENIZE.module)
