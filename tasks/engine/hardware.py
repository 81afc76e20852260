"""What this machine is: cores, CPU flags and model, native bf16, int8 dot products, peak memory, and the
measured matmul peak of each precision (MFU's denominator). Facts only: nothing here builds a model or
trains (step timing is tasks/engine/step_timing.py), so the stages that read a machine fact keep the
trainer out of their code hash."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import torch

log = logging.getLogger("cpuforge.hardware")

PEAK_SIZE = 2048


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def int8_dot_product() -> str:
    """The CPU's int8 dot-product instructions, which decide how fast (and, without them, how
    accurately for signed weights) onnxruntime's int8 kernels run."""
    flags = cpu_flags()
    for flag in ("amx_int8", "avx512_vnni", "avx_vnni"):
        if flag in flags:
            return flag
    return "none (no VNNI/AMX)"


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB. VmHWM, not ru_maxrss: Linux carries ru_maxrss
    across fork and exec, so a child started by a big process would report its parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> None:
    """Start this process's peak resident memory over from what it holds now, so that a training's
    peak_rss_mb is its own: in a run, model.size=auto times bigger shapes in the same process first
    (6.5 GB on a first demo run). Linux 4.0+; elsewhere the peak stays the process's."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset VmHWM to the current RSS (proc(5))


def has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX: without them bf16 matmuls are emulated and far slower than fp32."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def peak_size(dtype: torch.dtype) -> int:
    """The matmul size the peak is measured at. Emulated bf16 runs at ~1 GFLOP/s: one 2048^3
    product would take most of a minute, and a smaller one measures the same (low) rate."""
    return PEAK_SIZE if dtype == torch.float32 or has_native_bf16() else 512


def measure_matmul_peak(threads: int, dtype: torch.dtype = torch.float32, size: int = PEAK_SIZE,
                        seconds: float = 1.5) -> float:
    """Sustained FLOP/s of a size^3 matmul with this many threads (best of repeated runs)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        out = torch.empty(size, size, dtype=dtype)
        torch.mm(a, b, out=out)  # warm-up
        best, deadline = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            best = max(best, 2 * size**3 / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(previous)


def matmul_peak(threads: int, cache_dir: Path, dtype: torch.dtype = torch.float32) -> float:
    """The best matmul rate ever measured here per (CPU, threads, dtype, torch version).

    Noise from other processes can only make a measurement low, so each call measures again
    and the cache keeps the maximum: MFU is never flattered by a slow first reading. The first
    reading takes 1.5 s; later ones 0.3 s (a few products), which is enough to raise a low cache
    and costs a short training stage less of its budget.
    """
    from cpuforge.models.fileio import atomic_write_json

    key = f"{cpu_model()}|{threads}|{dtype}|{torch.__version__}"
    cache = cache_dir / "matmul_peak.json"
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    measured = measure_matmul_peak(threads, dtype, peak_size(dtype), seconds=0.3 if key in known else 1.5)
    if measured > known.get(key, 0.0):
        known[key] = measured
        atomic_write_json(cache, known)
    log.info("%s matmul peak with %d threads: %.1f GFLOP/s (this measurement %.1f)",
             str(dtype).removeprefix("torch."), threads, known[key] / 1e9, measured / 1e9)
    return float(known[key])
