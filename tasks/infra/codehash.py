"""The code a stage's output depends on, as one hash: the stage's module and every project module it
imports, directly or through others, read from source (nothing is imported), and the declarations of
the config sections it reads.

It is part of the stage key, so editing the trainer re-runs pretraining and recovery, and leaves
tokenization reused; a version bumped by hand (StageSpec.version) was easy to forget. Imports are
found with `ast`, including those inside functions, so a module imported lazily still counts.

The config's declarations (tasks/config/settings.py) are one file for every stage, so they are not
hashed as a file: a stage's key holds the declaration of each section it reads (the section's class
and the module-level names it uses, read with `ast`) with its help texts, docstrings and error
messages left out. Editing recover's section, or any help text, re-keys no tokenization; a changed
validator or default of a section re-keys the stages that read it.
"""

from __future__ import annotations

import ast
import copy
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
# Hashed per section (section_hashes), not as a file; the modules it imports stay in the closure.
DECLARATIONS = "cpuforge.tasks.config.settings"
CONFIG_CLASS = "Config"  # its fields name the sections and their classes


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
def _tree(module: str) -> ast.Module:
    """A project module's syntax tree, parsed once however many closures and questions read it."""
    return ast.parse(_source_file(module).read_text(encoding="utf-8"))


@functools.cache
def _imports(module: str) -> frozenset[str]:
    """Project modules named by the import statements of one module (relative imports resolved)."""
    path = _source_file(module)
    if path is None:
        return frozenset()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(_tree(module)):
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
    """The module and every project module it imports, transitively, less the registry, the
    infrastructure (NOT_COMPUTING) and the config's declarations (hashed per section instead)."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(i for i in _imports(name) - seen if _computes(i))
    return frozenset(seen - {DECLARATIONS})


@functools.cache
def _declarations() -> tuple[dict[str, ast.AST], dict[str, str]]:
    """The config module's top-level definitions by name, and each section's class name (Config's fields)."""
    defined: dict[str, ast.AST] = {}
    for node in _tree(DECLARATIONS).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            defined[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    defined[target.id] = node
    sections = {stmt.target.id: stmt.annotation.id for stmt in defined[CONFIG_CLASS].body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.annotation, ast.Name)}
    return defined, sections


class _WithoutDocs(ast.NodeTransformer):
    """Drops what only people read: docstrings, `description=` / `__doc__=` texts, error messages."""

    def visit_keyword(self, node: ast.keyword) -> ast.keyword | None:
        return None if node.arg in ("description", "__doc__") else self.generic_visit(node)

    def visit_Raise(self, node: ast.Raise) -> ast.Raise:
        if isinstance(node.exc, ast.Call):  # raise SomeError("message"): the type matters, the text does not
            node.exc.args, node.exc.keywords = [], []
        return node

    def generic_visit(self, node: ast.AST) -> ast.AST:
        body = getattr(node, "body", None)
        if (isinstance(node, ast.FunctionDef | ast.ClassDef | ast.Module) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
        return super().generic_visit(node)


@functools.cache
def _declaration_hash(name: str) -> str:
    """sha256 of one top-level name of the config module and of every top-level name it uses, their
    help texts left out (two edits that differ only in what people read hash the same)."""
    defined, _ = _declarations()
    parts, seen, todo = [], set(), [name]
    while todo:
        current = todo.pop()
        if current in seen or current not in defined:
            continue
        seen.add(current)
        node = _WithoutDocs().visit(copy.deepcopy(defined[current]))
        parts.append(ast.dump(node, annotate_fields=False))
        todo.extend(sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name)} - seen))
    return hashlib.sha256("\n".join(sorted(parts)).encode()).hexdigest()


def section_hashes(sections: tuple[str, ...] | list[str]) -> dict[str, str]:
    """The declaration hash of each config section, by `<config module>:<section>`."""
    _, classes = _declarations()
    return {f"{DECLARATIONS}:{s}": _declaration_hash(classes[s]) for s in sections}


@functools.cache
def _helpers_used(module: str) -> frozenset[str]:
    """Names other than sections that the closure's modules import from the config module (constants,
    functions): code the stage runs. Section classes and Config are types there; their values reach a
    stage only through its declared sections."""
    _, classes = _declarations()
    types = {CONFIG_CLASS, *classes.values()}
    used: set[str] = set()
    package, _, leaf = DECLARATIONS.rpartition(".")
    for name in module_closure(module):
        for node in ast.walk(_tree(name)):
            if isinstance(node, ast.ImportFrom) and node.module == DECLARATIONS:
                used.update(alias.name for alias in node.names if alias.name not in types)
            elif (isinstance(node, ast.Import) and any(a.name == DECLARATIONS for a in node.names)) or (
                    isinstance(node, ast.ImportFrom) and node.module == package and any(a.name == leaf for a in node.names)):
                used.update(n for n in _declarations()[0] if n not in types)  # the module itself: any name may be read
    return frozenset(used)


@functools.cache
def _module_hashes(module: str) -> dict[str, str]:
    return {name: hashlib.sha256(_source_file(name).read_bytes()).hexdigest()
            for name in sorted(module_closure(module)) if _source_file(name) is not None}


def module_hashes(module: str, sections: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 of the source of each module in the closure, by module name, and of the declaration of
    each config section the stage reads (section_hashes) and of any other config name its code imports."""
    helpers = {f"{DECLARATIONS}:{name}": _declaration_hash(name) for name in sorted(_helpers_used(module))}
    return {**_module_hashes(module), **section_hashes(sections), **helpers}


def code_hash(module: str, sections: tuple[str, ...] = ()) -> str:
    """One hash over the module's closure and its sections' declarations: changes when any of them does."""
    hashes = module_hashes(module, sections)
    return hashlib.sha256("\n".join(f"{n}={h}" for n, h in hashes.items()).encode()).hexdigest()
