"""The shape of the code, checked from its source: imports flow flows -> tasks -> models with no
cycles, the pipeline's infrastructure and the training engine import no stage, and MLflow is
reached only through tasks/infra/ (design.md)."""

from __future__ import annotations

from cpuforge.tasks import stages
from cpuforge.tasks.infra.codehash import PROJECT_PACKAGES, ROOT, _imports

STAGES_PACKAGE = "cpuforge.tasks.stages"


def project_modules() -> list[str]:
    modules = []
    for package in PROJECT_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules.append(".".join(("cpuforge", *(parts[:-1] if parts[-1] == "__init__" else parts))))
    return modules


def graph() -> dict[str, set[str]]:
    modules = set(project_modules())
    return {m: {i for i in _imports(m) if i in modules and i != m} for m in modules}


def test_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in edges[module]:
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target] if target in path else [module, target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in edges:
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


def test_imports_flow_flows_tasks_models():
    for module, targets in graph().items():
        layer = module.split(".")[1]
        allowed = {"flows": {"flows", "tasks", "models"}, "tasks": {"tasks", "models"}, "models": {"models"}}[layer]
        assert {t.split(".")[1] for t in targets} <= allowed, (module, targets)


def test_infrastructure_and_engine_import_no_stage():
    for module, targets in graph().items():
        if module.startswith(("cpuforge.tasks.infra.", "cpuforge.tasks.engine.")):
            stages_used = {t for t in targets if t.startswith(STAGES_PACKAGE + ".")}
            assert not stages_used, (module, stages_used)
        if module.startswith("cpuforge.tasks.infra."):
            assert not any(t.startswith("cpuforge.tasks.engine.") for t in targets), module


def test_the_engine_imports_nothing_of_the_pipeline():
    """The training and measuring engine is handed what the pipeline plugs in (callbacks, TrainingHooks by
    dotted path): it imports neither its infrastructure, nor a stage, nor the release side, nor the flows."""
    pipeline = ("cpuforge.tasks.infra", "cpuforge.tasks.stages", "cpuforge.tasks.release", "cpuforge.flows")
    modules = [m for m in graph() if m.startswith("cpuforge.tasks.engine.")]
    assert "cpuforge.tasks.engine.training_run" in modules
    for module in modules:
        used = {t for t in _imports(module) if any(t == p or t.startswith(p + ".") for p in pipeline)}
        assert not used, (module, used)


def test_the_stages_folder_holds_the_registered_stages_and_nothing_else():
    """tasks/stages/ is the pipeline: its __init__ is the registry, and every other module in it is
    a registered stage named as in the registry (and every registered stage is there)."""
    folder = ROOT / "tasks" / "stages"
    modules = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    registered = {spec.module.rsplit(".", 1)[1] for spec in stages.BY_NAME.values()}
    assert modules == registered == set(stages.BY_NAME), (modules, registered)
    assert not [p for p in folder.iterdir() if p.is_dir() and p.name != "__pycache__"]


def test_tasks_top_level_holds_folders_only():
    """Every module of tasks/ stands in the folder of its role (stages, config, data, records,
    release, engine, infra): nothing loose beside them."""
    loose = sorted(p.name for p in (ROOT / "tasks").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"put {loose} in the folder of its role (docs/architecture.md lists them)"


def _imports_package(path, package: str) -> bool:
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if any(n == package or n.startswith(package + ".") for n in names):
            return True
    return False


def test_mlflow_only_through_the_infrastructure_and_models_stay_pure():
    for package in PROJECT_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if _imports_package(path, "mlflow"):
                assert rel.startswith("tasks/infra/"), f"{rel} imports mlflow: go through tasks/infra/tracking.py"
            if rel.startswith("models/"):
                assert not _imports_package(path, "prefect") and not _imports_package(path, "mlflow"), rel


def test_every_package_folder_is_installed():
    """pyproject.toml names the packages one by one: a folder left out installs in editable mode (which maps
    the top folders) and is missing from a wheel, so `cpuforge` fails to start after `pip install .`."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(("cpuforge", *init.parent.relative_to(ROOT).parts))
             for package in PROJECT_PACKAGES for init in (ROOT / package).rglob("__init__.py")}
    assert found == listed, f"add to pyproject.toml: {sorted(found - listed)}; remove: {sorted(listed - found)}"
