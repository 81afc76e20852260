"""`python -m cpuforge.tasks.engine.measure ARGS.json RESULT.json`: measure one model variant in a process of its own
(or, with ``"speeds": true`` in ARGS, time every variant in alternation, see scoring.measure_speeds; with
``"gguf": true``, a GGUF file in llama.cpp, see llama_cpp_measure).

A fresh interpreter (not a multiprocessing child, which would inherit the parent's sys.path,
polluted by onnxruntime.quantization with a folder holding another package named `models`),
so the peak RSS it reports belongs to this variant alone. Progress goes to stdout, one line at a time,
each starting with PROGRESS.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cpuforge.models.fileio import atomic_write_json
from cpuforge.tasks.engine.scoring import measure_speeds, measure_variant

PROGRESS = "cpuforge-progress: "  # stdout lines the parent passes on to the person waiting


def _progress(line: str) -> None:
    print(PROGRESS + line, flush=True)


def main(args_path: str, result_path: str) -> None:
    kwargs = json.loads(Path(args_path).read_text())
    if kwargs.pop("gguf", False):  # a GGUF file in llama.cpp
        from cpuforge.tasks.engine.llama_cpp_measure import measure_gguf as measure
    else:
        measure = measure_speeds if kwargs.pop("speeds", False) else measure_variant
    atomic_write_json(Path(result_path), measure(**kwargs, progress=_progress))


if __name__ == "__main__":
    main(*sys.argv[1:3])
