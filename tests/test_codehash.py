"""Stage keys know the code: an edit re-runs the stages whose code it can change, and nothing else."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from cpuforge.tasks.infra.codehash import module_closure

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("tokenize", "pretrain", "prune", "recover", "export", "quantize", "evaluate", "gguf")


def stage_code_hashes(project: Path) -> dict[str, str]:
    """Each stage's code hash, computed by a fresh interpreter on this copy of the project (laid out as
    the installed namespace, first on the path)."""
    script = ("import json; from cpuforge.tasks.infra.codehash import code_hash; "
              f"print(json.dumps({{s: code_hash('cpuforge.tasks.stages.' + s) for s in {STAGES!r}}}))")
    out = subprocess.run([sys.executable, "-c", script], cwd=project, env={"PYTHONPATH": str(project)},
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_editing_the_trainer_changes_the_training_stages_keys_and_not_tokenize(tmp_path):
    project = tmp_path / "project"
    for package in ("flows", "tasks", "models"):
        shutil.copytree(ROOT / package, project / "cpuforge" / package, ignore=shutil.ignore_patterns("__pycache__"))
    before = stage_code_hashes(project)
    trainer = project / "cpuforge" / "tasks" / "engine" / "trainer.py"
    source = trainer.read_text()
    edited = source.replace("def lr_at(step: int, s: TrainConfig, horizon: int) -> float:\n",
                            "def lr_at(step: int, s: TrainConfig, horizon: int) -> float:\n    step = max(step, 0)\n")
    assert edited != source
    trainer.write_text(edited)
    after = stage_code_hashes(project)
    changed = {s for s in STAGES if before[s] != after[s]}
    assert {"pretrain", "recover"} <= changed
    assert "tokenize" not in changed and "export" not in changed

    # The registry and the infrastructure run, key and report stages; they compute nothing in them.
    for name, old, new in (("stages/__init__.py", "# The final model as GGUF", "# A new stage here.\n# The final model as GGUF"),
                           ("infra/tracking.py", "def log_run_metrics(", "def unused_helper():\n    pass\n\n\ndef log_run_metrics(")):
        module = project / "cpuforge" / "tasks" / name
        text = module.read_text()
        assert old in text
        module.write_text(text.replace(old, new, 1))
    assert stage_code_hashes(project) == after


def test_imports_inside_functions_count():
    # step_timing imports the model only inside the function that measures a training step
    assert "cpuforge.models.llama" in module_closure("cpuforge.tasks.engine.step_timing")
    # recover imports the training engine's launcher; the engine's trainer belongs to recover's closure through it
    assert "cpuforge.tasks.engine.trainer" in module_closure("cpuforge.tasks.stages.recover")
    assert "cpuforge.tasks.engine.trainer" in module_closure("cpuforge.tasks.stages.pretrain")
    assert "cpuforge.models.llama" in module_closure("cpuforge.tasks.stages.export")
    assert all(name.split(".")[1] in ("flows", "tasks", "models") for name in module_closure("cpuforge.tasks.stages.evaluate"))
