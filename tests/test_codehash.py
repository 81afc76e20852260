"""Stage keys know the code: an edit re-runs the stages whose code it can change, and nothing else."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from cpuforge.tasks.codehash import module_closure

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("tokenize", "pretrain", "prune", "recover", "export", "quantize", "evaluate")


def stage_code_hashes(project: Path) -> dict[str, str]:
    """Each stage's code hash, computed by a fresh interpreter on this copy of the project (laid out as
    the installed namespace, first on the path)."""
    script = ("import json; from cpuforge.tasks.codehash import code_hash; "
              f"print(json.dumps({{s: code_hash('cpuforge.tasks.' + s) for s in {STAGES!r}}}))")
    out = subprocess.run([sys.executable, "-c", script], cwd=project, env={"PYTHONPATH": str(project)},
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_editing_the_trainer_changes_the_training_stages_keys_and_not_tokenize(tmp_path):
    project = tmp_path / "project"
    for package in ("flows", "tasks", "models"):
        shutil.copytree(ROOT / package, project / "cpuforge" / package, ignore=shutil.ignore_patterns("__pycache__"))
    before = stage_code_hashes(project)
    trainer = project / "cpuforge" / "tasks" / "trainer.py"
    source = trainer.read_text()
    edited = source.replace("def lr_at(step: int, s: TrainSettings, horizon: int) -> float:\n",
                            "def lr_at(step: int, s: TrainSettings, horizon: int) -> float:\n    step = max(step, 0)\n")
    assert edited != source
    trainer.write_text(edited)
    after = stage_code_hashes(project)
    changed = {s for s in STAGES if before[s] != after[s]}
    assert {"pretrain", "recover"} <= changed
    assert "tokenize" not in changed and "export" not in changed


def test_lazy_imports_inside_functions_count():
    # training_run imports the recover stage's loss inside a function; it still belongs to the closure
    assert "cpuforge.tasks.recover" in module_closure("cpuforge.tasks.training_run")
    assert "cpuforge.tasks.trainer" in module_closure("cpuforge.tasks.pretrain")
    assert "cpuforge.models.llama" in module_closure("cpuforge.tasks.export")
    assert all(name.split(".")[1] in ("flows", "tasks", "models") for name in module_closure("cpuforge.tasks.evaluate"))
