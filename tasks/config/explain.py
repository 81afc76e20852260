"""`cpuforge config --explain`: every setting with its description, type, default and resolved value,
read from the pydantic fields of tasks/config/settings.py (their descriptions are the documentation)."""

from __future__ import annotations

import json
import textwrap
import types
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic_core import PydanticUndefined

from cpuforge.tasks.config.settings import SECTIONS, Config


@dataclass(frozen=True)
class Setting:
    name: str  # section.key, as --set and YAML files name it
    type: str
    default: Any
    value: Any
    description: str

    @property
    def changed(self) -> bool:
        return self.value != self.default


def type_name(annotation: Any) -> str:
    """A field's type as a user writes it: 'int | None', "'auto' | 'fp32' | 'bf16'", 'list[int]'."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return type_name(args[0])
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def settings(cfg: Config) -> list[Setting]:
    rows = []
    for section, cls in SECTIONS.items():
        values = getattr(cfg, section).model_dump(mode="json")
        for key, field in cls.model_fields.items():
            default = field.default if field.default is not PydanticUndefined else None
            if field.default_factory is not None:
                default = field.default_factory()
            rows.append(Setting(f"{section}.{key}", type_name(field.annotation), _plain(default), values[key],
                                " ".join((field.description or "").split())))
    return rows


def _plain(value: Any) -> Any:
    """A default as the resolved config shows it (tuples as lists, as JSON and YAML have them)."""
    return json.loads(json.dumps(value, default=str))


def _show(value: Any) -> str:
    return "null" if value is None else json.dumps(value) if not isinstance(value, str) else value


def explain(cfg: Config, width: int = 100) -> str:
    """One block per setting: name, type, default, this profile's value (marked * where it differs)."""
    lines = [f"cpuforge settings, profile {cfg.profile!r} (* = differs from the default). "
             "Change one with --set SECTION.KEY=VALUE or a --config YAML file.", ""]
    section = None
    for s in settings(cfg):
        if s.name.split(".")[0] != section:
            section = s.name.split(".")[0]
            lines += ["", f"[{section}]"] if len(lines) > 2 else [f"[{section}]"]
        mark = "*" if s.changed else " "
        lines.append(f"{mark} {s.name}: {s.type}  default: {_show(s.default)}  {cfg.profile}: {_show(s.value)}")
        lines += textwrap.wrap(s.description, width=width, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines) + "\n"
