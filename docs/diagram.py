"""Draw docs/images/pipeline.svg: the stages, what flows between them, and where Prefect and MLflow
see it. Plain SVG text, no dependencies: `python docs/diagram.py` after changing a stage."""

from __future__ import annotations

from html import escape
from pathlib import Path

OUT = Path(__file__).resolve().parent / "images" / "pipeline.svg"

# (stage, what it hands on and how) in pipeline order, each to the next; tasks/stages/__init__.py holds the real order.
STAGES = [
    ("tokenize", ["corpus → BPE", "tokenizer.json", "train.bin, val.bin"]),
    ("pretrain", ["checkpoint", "(weights + optimizer,", "resumable)"]),
    ("prune", ["smaller checkpoint", "heads, MLP, width", "by activations"]),
    ("recover", ["recovered weights", "KD from the teacher", "+ LM loss"]),
    ("export", ["model.onnx", "dynamic batch, seq", "parity vs PyTorch"]),
    ("quantize", ["model.int8.onnx", "dynamic vs static,", "kept by a rule"]),
    ("evaluate", ["every variant:", "bits/byte, size, tok/s", "report.md, plot"]),
    ("register", ["ONNX model version", "alias candidate;", "champion if better"]),
]

W, BOX_W, GAP, LEFT = 1240, 128, 22, 31
TOP, BOX_H = 128, 104
PREFECT_Y, PREFECT_H = 282, 84
MLFLOW_Y, MLFLOW_H = 398, 120
BLUE, BLUE_BG = "#1f5fbf", "#eaf1fb"
PREFECT, PREFECT_BG = "#2d6df6", "#eef3ff"
MLFLOW, MLFLOW_BG = "#0b7a75", "#e8f6f5"


def text(x: float, y: float, s: str, size: int = 12, weight: str = "normal", anchor: str = "middle",
         fill: str = "#222", style: str = "normal") -> str:
    return (f'<text x="{x:.0f}" y="{y:.0f}" font-size="{size}" font-weight="{weight}" text-anchor="{anchor}" '
            f'fill="{fill}" font-style="{style}">{escape(s)}</text>')


def box_x(i: int) -> int:
    return LEFT + i * (BOX_W + GAP)


def draw() -> str:
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="540" viewBox="0 0 {W} 540" '
             'font-family="DejaVu Sans, Helvetica, Arial, sans-serif">',
             '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
             'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#444"/></marker></defs>',
             f'<rect width="{W}" height="540" fill="white"/>',
             text(W / 2, 28, "cpuforge: one Prefect flow, one MLflow run per pipeline run, one folder per stage",
                  size=17, weight="bold")]
    # the work folder: where the outputs live and why a rerun reuses them
    parts += [f'<rect x="{LEFT}" y="46" width="{W - 2 * LEFT}" height="40" rx="6" fill="#f5f5f5" stroke="#999"/>',
              text(LEFT + 12, 64, "work folder  stages/<stage>-<key>/", size=13, weight="bold", anchor="start"),
              text(LEFT + 12, 80, "key = hash of the stage's config sections, its inputs' keys and its code: the "
                   "same key is reused (Prefect shows Cached); written under .partial, renamed when complete",
                   size=11, anchor="start", fill="#444")]
    # the teacher goes from pretrain to recover around prune
    x1, x2 = box_x(1) + BOX_W / 2, box_x(3) + BOX_W / 2
    parts += [f'<path d="M{x1:.0f},{TOP} C{x1:.0f},{TOP - 34} {x2:.0f},{TOP - 34} {x2:.0f},{TOP - 2}" fill="none" '
              f'stroke="#444" stroke-dasharray="5,3" marker-end="url(#arrow)"/>',
              text((x1 + x2) / 2, TOP - 28, "teacher (unpruned)", size=11, fill="#444", style="italic")]
    for i, (name, lines) in enumerate(STAGES):
        x = box_x(i)
        parts += [f'<rect x="{x}" y="{TOP}" width="{BOX_W}" height="{BOX_H}" rx="8" fill="{BLUE_BG}" '
                  f'stroke="{BLUE}" stroke-width="1.5"/>',
                  text(x + BOX_W / 2, TOP + 24, name, size=15, weight="bold", fill=BLUE)]
        parts += [text(x + BOX_W / 2, TOP + 48 + 17 * j, line, size=11) for j, line in enumerate(lines)]
        if i < len(STAGES) - 1:
            y = TOP + BOX_H / 2
            parts.append(f'<line x1="{x + BOX_W}" y1="{y}" x2="{x + BOX_W + GAP - 1}" y2="{y}" stroke="#444" '
                         'stroke-width="1.5" marker-end="url(#arrow)"/>')
        cx = x + BOX_W / 2  # each stage is seen by both: a Prefect task and an MLflow nested run
        parts += [f'<line x1="{cx}" y1="{TOP + BOX_H}" x2="{cx}" y2="{PREFECT_Y}" stroke="{PREFECT}" '
                  'stroke-dasharray="3,3"/>',
                  f'<line x1="{cx}" y1="{PREFECT_Y + PREFECT_H}" x2="{cx}" y2="{MLFLOW_Y}" stroke="{MLFLOW}" '
                  'stroke-dasharray="3,3"/>']
    # Prefect
    parts += [f'<rect x="{LEFT}" y="{PREFECT_Y}" width="{W - 2 * LEFT}" height="{PREFECT_H}" rx="8" '
              f'fill="{PREFECT_BG}" stroke="{PREFECT}" stroke-width="1.5"/>',
              text(LEFT + 14, PREFECT_Y + 24, "Prefect", size=15, weight="bold", anchor="start", fill=PREFECT),
              text(LEFT + 92, PREFECT_Y + 24, "flow run of cpuforge-pipeline (cpuforge run, a deployment, a schedule): one "
                   "task run per stage, Completed / Cached / Failed, retries for training", size=12, anchor="start"),
              text(LEFT + 14, PREFECT_Y + 46, "while a stage runs: a progress artifact (share of its budget) and "
                   "its markdown headline (tokens/s, last val bits/byte, time left)", size=12, anchor="start"),
              text(LEFT + 14, PREFECT_Y + 66, "when it ends: the headline numbers and a link to the stage's MLflow "
                   "run; evaluate adds the variants table and the report", size=12, anchor="start")]
    # MLflow, with the registry at the right
    reg_w = 300
    parts += [f'<rect x="{LEFT}" y="{MLFLOW_Y}" width="{W - 2 * LEFT}" height="{MLFLOW_H}" rx="8" '
              f'fill="{MLFLOW_BG}" stroke="{MLFLOW}" stroke-width="1.5"/>',
              text(LEFT + 14, MLFLOW_Y + 24, "MLflow", size=15, weight="bold", anchor="start", fill=MLFLOW),
              text(LEFT + 86, MLFLOW_Y + 24, "one parent run per pipeline run, a nested run per stage",
                   size=12, anchor="start"),
              text(LEFT + 14, MLFLOW_Y + 48, "params: the stage's config sections and its key", size=12, anchor="start"),
              text(LEFT + 14, MLFLOW_Y + 68, "metrics: per step while training (train/loss, val/bpb, tokens/s, MFU) "
                   "and the stage's summary", size=12, anchor="start"),
              text(LEFT + 14, MLFLOW_Y + 88, "artifacts: model, loss curve, samples, reports; the corpus as a "
                   "dataset input; cached stages point to", size=12, anchor="start"),
              text(LEFT + 14, MLFLOW_Y + 106, "the run that built them", size=12, anchor="start"),
              f'<rect x="{W - LEFT - reg_w - 10}" y="{MLFLOW_Y + 12}" width="{reg_w}" height="{MLFLOW_H - 24}" rx="6" '
              f'fill="white" stroke="{MLFLOW}"/>',
              text(W - LEFT - 10 - reg_w / 2, MLFLOW_Y + 36, "model registry: cpuforge-lm", size=13, weight="bold",
                   fill=MLFLOW),
              text(W - LEFT - 10 - reg_w / 2, MLFLOW_Y + 58, "a version per run (the int8 ONNX model)", size=11),
              text(W - LEFT - 10 - reg_w / 2, MLFLOW_Y + 76, "@candidate: the newest", size=11),
              text(W - LEFT - 10 - reg_w / 2, MLFLOW_Y + 94, "@champion: moved only when it beats the current",
                   size=11)]
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(draw())
    print(f"wrote {OUT}")
