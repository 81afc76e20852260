"""The code a stage's output depends on, as one hash: the stage's module and every project module it
imports, directly or through others, read from source (nothing is imported).

It is part of the stage key, so editing the trainer re-runs pretraining and recovery, and leaves
tokenization reused; a version bumped by hand (StageSpec.version) was easy to forget. Imports are
found with `ast`, including those inside functions, so a module imported lazily still counts.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

NAMESPACE = "cpuforge"
PROJECT_PACKAGES = ("flows", "tasks", "models")  # installed as cpuforge.flows, cpuforge.tasks, cpuforge.models
ROOT = Path(__file__).resolve().parents[2]  # the folder holding flows/, tasks/, models/
# What runs, keys, stores and reports a stage rather than what it computes: the registry's
# declarations (a stage's version, sections and inputs are in its key already) and the pipeline's
# infrastructure. Editing them (adding a stage, a tracking fix) must not rebuild every stage.
# The registry is the stages package's __init__ (the stage modules beside it do compute).
NOT_COMPUTING = ("cpuforge.tasks.stages", "cpuforge.tasks.infra")
NOT_COMPUTING_PACKAGES = ("cpuforge.tasks.infra",)


def _computes(module: str) -> bool:
    return module not in NOT_COMPUTING and not any(module.startswith(p + ".") for p in NOT_COMPUTING_PACKAGES)


def _source_file(module: str) -> Path | None:
    """The module's source file under the project root, found without importing anything."""
    if not _is_project(module):
        return None
    base = ROOT.joinpath(*module.split(".")[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _is_project(name: str) -> bool:
    parts = name.split(".")
    return len(parts) > 1 and parts[0] == NAMESPACE and parts[1] in PROJECT_PACKAGES


@functools.cache
def _imports(module: str) -> frozenset[str]:
    """Project modules named by the import statements of one module (relative imports resolved)."""
    path = _source_file(module)
    if path is None:
        return frozenset()
    source = path.read_text(encoding="utf-8")
    package = module if path is not None and path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:  # `from cpuforge.tasks import tracking` names a module, `from cpuforge.tasks.x import f` does not
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _is_project(candidate) and _source_file(candidate) else base)
    return frozenset(name for name in found if _is_project(name) and _source_file(name))


@functools.cache
def module_closure(module: str) -> frozenset[str]:
    """The module and every project module it imports, transitively, less the registry and the
    infrastructure (NOT_COMPUTING)."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(i for i in _imports(name) - seen if _computes(i))
    return frozenset(seen)


@functools.cache
def module_hashes(module: str) -> dict[str, str]:
    """sha256 of the source of each module in the closure, by module name."""
    return {name: hashlib.sha256(_source_file(name).read_bytes()).hexdigest()
            for name in sorted(module_closure(module)) if _source_file(name) is not None}


def code_hash(module: str) -> str:
    """One hash over the module's closure: changes when any of its modules' source does."""
    return hashlib.sha256("\n".join(f"{n}={h}" for n, h in module_hashes(module).items()).encode()).hexdigest()
