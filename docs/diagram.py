"""Draw docs/images/pipeline.svg from the stage registry (tasks/stages/__init__.py): a box per stage of
PIPELINE in order, an arrow per input it `needs`, adopt (COMPRESS's stand-in) under the stage it stands
for, the register step, and where Prefect and MLflow see each stage. Also writes the registry's stage
table into docs/architecture.md (between the stages:begin/end markers). Plain SVG text, deterministic,
no dependencies beyond the registry: `python docs/diagram.py` after changing a stage
(tests/test_plan.py fails while either is stale)."""

from __future__ import annotations

import hashlib
import json
from html import escape
from pathlib import Path

from cpuforge.tasks import stages
from cpuforge.tasks.infra.stage import StageSpec

DOCS = Path(__file__).resolve().parent
OUT = DOCS / "images" / "pipeline.svg"
ARCHITECTURE = DOCS / "architecture.md"
TABLE_BEGIN, TABLE_END = "<!-- stages:begin -->\n", "<!-- stages:end -->"

BOX_W, GAP, LEFT, LINE_H = 124, 22, 31, 16
LEVEL_H, BUS_FANOUT = 16, 3  # arcs above the row, one level each; a stage feeding more than 3 later ones: a bus below
BLUE, BLUE_BG = "#1f5fbf", "#eaf1fb"
PREFECT, PREFECT_BG = "#2d6df6", "#eef3ff"
MLFLOW, MLFLOW_BG = "#0b7a75", "#e8f6f5"
GREY = "#444"


def registry_digest() -> str:
    """The registry's structure as the picture draws it: a new stage, input or output changes it."""
    shape = [[s.name, list(s.needs), list(s.provides), list(s.evaluates or ()), s.stands_for or "", s.resumable]
             for s in (*stages.PIPELINE, *extra_specs())]
    return hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:16]


def extra_specs() -> list[StageSpec]:
    """COMPRESS's stand-ins (adopt), drawn under the stage they stand for."""
    return [spec for spec in stages.COMPRESS if spec not in stages.PIPELINE]


def text(x: float, y: float, s: str, size: int = 12, weight: str = "normal", anchor: str = "middle",
         fill: str = "#222", style: str = "normal") -> str:
    return (f'<text x="{x:.0f}" y="{y:.0f}" font-size="{size}" font-weight="{weight}" text-anchor="{anchor}" '
            f'fill="{fill}" font-style="{style}">{escape(s)}</text>')


def wrap(words: str, width: int = 18) -> list[str]:
    lines: list[str] = []
    for word in words.split(" "):
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def caption(spec: StageSpec) -> list[str]:
    """What the box says, all from the spec: its outputs, its config sections, how it is evaluated."""
    lines = wrap("→ " + ", ".join(spec.provides)) + wrap("config: " + (", ".join(spec.sections) or "none"))
    if spec.evaluates:
        lines.append(f"variant {spec.evaluates[0]}")
    if spec.resumable:
        lines.append("resumable")
    return lines


REGISTER_CAPTION = ["the flow's last step:", f"{stages.FINAL_VARIANT} →", "@candidate, and", "@champion if better"]


def box_h() -> int:
    return 40 + LINE_H * max(len(caption(spec)) for spec in stages.PIPELINE)


def box_x(i: int) -> int:
    return LEFT + i * (BOX_W + GAP)


def columns() -> list[str]:
    """The row, left to right: the pipeline's stages, then the flow's register step."""
    return [*stages.names(stages.PIPELINE), "register"]


def register_needs() -> tuple[str, ...]:
    """What the flow's register step reads: tokenize's text, the final variant's stage, evaluate's figures."""
    final = next(s.name for s in stages.PIPELINE if s.evaluates and s.evaluates[0] == stages.FINAL_VARIANT)
    return (stages.PIPELINE[0].name, final, stages.EVALUATE.name)


def edges() -> list[tuple[int, int]]:
    """(source column, target column) for every input of every column."""
    col = {name: i for i, name in enumerate(columns())}
    needs = {**{s.name: s.needs for s in stages.PIPELINE}, "register": register_needs()}
    return [(col[src], col[dst]) for dst in columns() for src in needs[dst]]


def bus_sources(all_edges: list[tuple[int, int]]) -> set[int]:
    fanout = {src: sum(1 for s, d in all_edges if s == src and d > src + 1) for src, _ in all_edges}
    return {src for src, n in fanout.items() if n > BUS_FANOUT}


def arc_levels(arcs: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """Each arc above the row on the lowest level where it crosses no other (shorter arcs lower)."""
    levels: dict[tuple[int, int], int] = {}
    for arc in sorted(arcs, key=lambda a: (a[1] - a[0], a[0])):
        taken = {levels[o] for o in levels if o[0] < arc[1] and arc[0] < o[1]}
        levels[arc] = next(n for n in range(len(arcs) + 1) if n not in taken)
    return levels


def ends(arcs: list[tuple[int, int]]) -> dict[tuple[int, int], tuple[float, float]]:
    """Where each arc leaves its source (right half of the box top) and reaches its target (left half)."""
    out: dict[tuple[int, int], tuple[float, float]] = {}
    for arc in arcs:
        leaving = sorted(a for a in arcs if a[0] == arc[0])
        arriving = sorted((a for a in arcs if a[1] == arc[1]), reverse=True)
        x1 = box_x(arc[0]) + BOX_W * (0.6 + 0.3 * leaving.index(arc) / max(len(leaving), 1))
        x2 = box_x(arc[1]) + BOX_W * (0.1 + 0.35 * arriving.index(arc) / max(len(arriving), 1))
        out[arc] = (x1, x2)
    return out


def draw_row(top: int, all_edges: list[tuple[int, int]], bus: set[int]) -> list[str]:
    names, parts = columns(), []
    arcs = [(s, d) for s, d in all_edges if d > s + 1 and s not in bus]
    levels, xs = arc_levels(arcs), ends(arcs)
    for arc in arcs:
        (x1, x2), y = xs[arc], top - 14 - LEVEL_H * levels[arc]
        parts.append(f'<path d="M{x1:.0f},{top} V{y} H{x2:.0f} V{top - 2}" fill="none" stroke="{GREY}" '
                     'stroke-width="1.2" marker-end="url(#arrow)"/>')
    for i, name in enumerate(names):
        x, spec = box_x(i), stages.BY_NAME.get(name)
        dashed = "" if spec else ' stroke-dasharray="6,3"'
        parts += [f'<rect x="{x}" y="{top}" width="{BOX_W}" height="{box_h()}" rx="8" fill="{BLUE_BG}" '
                  f'stroke="{BLUE}" stroke-width="1.5"{dashed}/>',
                  text(x + BOX_W / 2, top + 24, name, size=15, weight="bold", fill=BLUE)]
        lines = caption(spec) if spec else REGISTER_CAPTION
        parts += [text(x + BOX_W / 2, top + 46 + LINE_H * j, line, size=11) for j, line in enumerate(lines)]
        if (i - 1, i) in all_edges:
            y = top + box_h() / 2
            parts.append(f'<line x1="{x - GAP}" y1="{y}" x2="{x - 1}" y2="{y}" stroke="{GREY}" '
                         'stroke-width="1.5" marker-end="url(#arrow)"/>')
    return parts


def draw_bus(top: int, all_edges: list[tuple[int, int]], bus: set[int]) -> list[str]:
    parts, y = [], top + box_h() + 16
    for src in sorted(bus):
        targets = sorted(d for s, d in all_edges if s == src and d > src + 1)
        x0 = box_x(src) + BOX_W / 2
        parts += [f'<path d="M{x0:.0f},{top + box_h()} V{y} H{box_x(targets[-1]) + 20}" fill="none" '
                  f'stroke="{GREY}" stroke-width="1.2"/>',
                  text(x0 + 8, y + 13, f"{columns()[src]}'s {', '.join(stages.BY_NAME[columns()[src]].provides)}: "
                       f"to every stage that reads them", size=11, anchor="start", fill=GREY, style="italic")]
        parts += [f'<line x1="{box_x(d) + 20}" y1="{y}" x2="{box_x(d) + 20}" y2="{top + box_h() + 2}" '
                  f'stroke="{GREY}" stroke-width="1.2" marker-end="url(#arrow)"/>' for d in targets]
    return parts


def draw_stand_ins(top: int) -> list[str]:
    parts = []
    for spec in extra_specs():
        i = columns().index(spec.stands_for)
        x, h = box_x(i), 62
        parts += [f'<line x1="{x + BOX_W / 2}" y1="{top}" x2="{x + BOX_W / 2}" y2="{top - 24}" stroke="{BLUE}" '
                  'stroke-dasharray="4,3"/>',
                  f'<rect x="{x}" y="{top}" width="{BOX_W}" height="{h}" rx="8" fill="white" stroke="{BLUE}" '
                  'stroke-width="1.5" stroke-dasharray="6,3"/>',
                  text(x + BOX_W / 2, top + 20, spec.name, size=14, weight="bold", fill=BLUE),
                  text(x + BOX_W / 2, top + 38, "compress flow: in", size=11),
                  text(x + BOX_W / 2, top + 54, f"{spec.stands_for}'s place", size=11)]
    return parts


def draw() -> str:
    all_edges = edges()
    bus = bus_sources(all_edges)
    arcs = [(s, d) for s, d in all_edges if d > s + 1 and s not in bus]
    n = len(columns())
    w = 2 * LEFT + n * BOX_W + (n - 1) * GAP
    top = 96 + 14 + LEVEL_H * (max(arc_levels(arcs).values(), default=0) + 1)
    stand_in_y = top + box_h() + 50
    prefect_y = stand_in_y + (80 if extra_specs() else 0)
    mlflow_y = prefect_y + 84 + 32
    height = mlflow_y + 120 + 22
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{height}" viewBox="0 0 {w} {height}" '
             'font-family="DejaVu Sans, Helvetica, Arial, sans-serif">',
             f"<!-- drawn by docs/diagram.py from the stage registry {registry_digest()} -->",
             '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
             f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{GREY}"/></marker></defs>',
             f'<rect width="{w}" height="{height}" fill="white"/>',
             text(w / 2, 28, "cpuforge: one Prefect flow, one MLflow run per pipeline run, one folder per stage",
                  size=17, weight="bold")]
    # the work folder: where the outputs live and why a rerun reuses them
    parts += [f'<rect x="{LEFT}" y="46" width="{w - 2 * LEFT}" height="40" rx="6" fill="#f5f5f5" stroke="#999"/>',
              text(LEFT + 12, 64, "work folder  stages/<stage>-<key>/", size=13, weight="bold", anchor="start"),
              text(LEFT + 12, 80, "key = hash of the stage's config sections, its inputs' keys and its code: the "
                   "same key is reused (Prefect shows Cached); written under .partial, renamed when complete",
                   size=11, anchor="start", fill=GREY)]
    for i in range(n):  # each stage is seen by both: a Prefect task and an MLflow nested run
        cx = box_x(i) + BOX_W / 2
        parts += [f'<line x1="{cx}" y1="{top + box_h()}" x2="{cx}" y2="{prefect_y}" stroke="{PREFECT}" '
                  'stroke-dasharray="3,3"/>',
                  f'<line x1="{cx}" y1="{prefect_y + 84}" x2="{cx}" y2="{mlflow_y}" stroke="{MLFLOW}" '
                  'stroke-dasharray="3,3"/>']
    parts += draw_row(top, all_edges, bus) + draw_bus(top, all_edges, bus) + draw_stand_ins(stand_in_y)
    parts += draw_prefect(prefect_y, w) + draw_mlflow(mlflow_y, w)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def draw_prefect(y: int, w: int) -> list[str]:
    return [f'<rect x="{LEFT}" y="{y}" width="{w - 2 * LEFT}" height="84" rx="8" '
            f'fill="{PREFECT_BG}" stroke="{PREFECT}" stroke-width="1.5"/>',
            text(LEFT + 14, y + 24, "Prefect", size=15, weight="bold", anchor="start", fill=PREFECT),
            text(LEFT + 92, y + 24, "flow run of cpuforge-pipeline (cpuforge run, a deployment, a schedule): one "
                 "task run per stage, Completed / Cached / Failed, retries for training", size=12, anchor="start"),
            text(LEFT + 14, y + 46, "while a stage runs: a progress artifact (share of its budget) and "
                 "its markdown headline (tokens/s, last val bits/byte, time left)", size=12, anchor="start"),
            text(LEFT + 14, y + 66, "when it ends: the headline numbers and a link to the stage's MLflow "
                 "run; evaluate adds the variants table and the report", size=12, anchor="start")]


def draw_mlflow(y: int, w: int) -> list[str]:
    reg_w, h = 300, 120
    return [f'<rect x="{LEFT}" y="{y}" width="{w - 2 * LEFT}" height="{h}" rx="8" '
            f'fill="{MLFLOW_BG}" stroke="{MLFLOW}" stroke-width="1.5"/>',
            text(LEFT + 14, y + 24, "MLflow", size=15, weight="bold", anchor="start", fill=MLFLOW),
            text(LEFT + 86, y + 24, "one parent run per pipeline run, a nested run per stage", size=12, anchor="start"),
            text(LEFT + 14, y + 48, "params: the stage's config sections and its key", size=12, anchor="start"),
            text(LEFT + 14, y + 68, "metrics: per step while training (train/loss, val/bpb, tokens/s, MFU) "
                 "and the stage's summary", size=12, anchor="start"),
            text(LEFT + 14, y + 88, "artifacts: model, loss curve, samples, reports; the corpus as a "
                 "dataset input; cached stages point to", size=12, anchor="start"),
            text(LEFT + 14, y + 106, "the run that built them", size=12, anchor="start"),
            f'<rect x="{w - LEFT - reg_w - 10}" y="{y + 12}" width="{reg_w}" height="{h - 24}" rx="6" '
            f'fill="white" stroke="{MLFLOW}"/>',
            text(w - LEFT - 10 - reg_w / 2, y + 36, "model registry: cpuforge-lm", size=13, weight="bold", fill=MLFLOW),
            text(w - LEFT - 10 - reg_w / 2, y + 58, f"a version per run (the {stages.FINAL_VARIANT} model)", size=11),
            text(w - LEFT - 10 - reg_w / 2, y + 76, "@candidate: the newest", size=11),
            text(w - LEFT - 10 - reg_w / 2, y + 94, "@champion: moved only when it beats the current", size=11)]


def architecture_page(page: str) -> str:
    """docs/architecture.md with the registry's stage table between the markers."""
    head, rest = page.split(TABLE_BEGIN)
    _, tail = rest.split(TABLE_END)
    return head + TABLE_BEGIN + stages.markdown_table() + TABLE_END + tail


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(draw())
    print(f"wrote {OUT}")
    ARCHITECTURE.write_text(architecture_page(ARCHITECTURE.read_text()))
    print(f"wrote the stage table in {ARCHITECTURE}")
