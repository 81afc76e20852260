"""Training keeps the memory a step frees for the next one (tasks/engine/allocator.py): with glibc's
defaults each step's big tensors were unmapped when freed and faulted in again by the next step."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's mallopt")

# A fresh process (glibc adapts its thresholds as a process runs): RSS with 16 MB allocated, then freed.
PROBE = """
import json, sys
from pathlib import Path
import numpy as np
from cpuforge.tasks.engine.allocator import keep_freed_memory

def rss_mb():
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))

tuned = keep_freed_memory() if sys.argv[1] == "tuned" else None
block = np.ones(16 << 17)  # 16 MB, written
held = rss_mb()
del block
print(json.dumps({"tuned": tuned, "held": held, "after_free": rss_mb()}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_memory_a_training_frees_stays_with_the_process_for_its_next_step():
    default, tuned = _probe("default"), _probe("tuned")
    assert tuned["tuned"] is True
    assert default["held"] - default["after_free"] > 12, "glibc's defaults should give a 16 MB block back at once"
    assert tuned["held"] - tuned["after_free"] < 4, "the freed 16 MB went back to the OS"


SIZING = """
import json
from pathlib import Path
from cpuforge.models.config import LlamaConfig, ladder_shape
from cpuforge.tasks.engine.hardware import peak_rss_mb
from cpuforge.tasks.engine.sizing import measure_shapes

def rss_mb():
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))

before = rss_mb()
shapes = [LlamaConfig(vocab_size=4096, block_size=128, **ladder_shape(d, n)) for d, n in ((192, 4), (320, 6))]
measure_shapes(shapes, 8, 1, rounds=1)
print(json.dumps({"before": before, "peak": peak_rss_mb(), "after": rss_mb()}))
"""


def test_model_sizing_gives_its_memory_back_before_the_stages_run():
    """model.size=auto times candidate shapes in the run's own process before any stage: what they held must
    not stay with the process through every stage after (a demo run's tokenize reported a 6.7 GB peak)."""
    out = subprocess.run([sys.executable, "-c", SIZING], capture_output=True, text=True, check=True)
    rss = json.loads(out.stdout)
    assert rss["peak"] - rss["before"] > 200  # the shapes did take memory
    assert rss["after"] - rss["before"] < (rss["peak"] - rss["before"]) / 4, rss
