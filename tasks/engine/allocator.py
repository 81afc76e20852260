"""glibc malloc settings for training: keep the memory a step frees for the next step.

A training step allocates and frees the same large tensors (activations, logits, gradients) every
step. glibc's defaults hand big blocks back to the OS as soon as they are freed: blocks over 128 KB
are mmap'ed and unmapped, and the heap's top is trimmed once 128 KB of it is free. So every step
page-faults its memory in again. glibc raises its mmap threshold by itself after such a block is
freed (to at most 32 MB), which is why a process that had run something big first trained faster
than a fresh one: the demo's recover step ran at 11.9k tok/s in the flow's process, after model
sizing, and 8.5k in a fresh one.

Measured on the AMX Xeon, fresh processes, the demo's recover step (bf16, distillation): 8.5k tok/s
with glibc's defaults, 12.1k with these settings. benchmarks/train_throughput.py (4.0M demo dims,
bf16): cpuforge eager 12.9k -> 14.4k, compiled 18.7k -> 19.4k, transformers 10.9k -> 13.8k.
Peak RSS: +5% (979 -> 1,025 MB in that benchmark).

The memory kept stays with the process until ``release_free_memory`` (glibc's malloc_trim): the
trainer calls it when it starts, so that what earlier work in the process freed (model sizing times
shapes up to ~100M parameters: 6.6 GB) is not held through the run, and when it ends.

glibc only (the only allocator here with mallopt); elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import functools
import platform

# mallopt parameters (malloc.h) and the values set.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {
    M_MMAP_THRESHOLD: 32 << 20,  # the most glibc allows: blocks up to 32 MB come from the heap and are reused
    M_TRIM_THRESHOLD: 1 << 30,  # keep up to 1 GB free at the heap's top rather than give it back each step
    M_TOP_PAD: 256 << 20,  # grow the heap 256 MB at a time: fewer brk calls and faults
}


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """This process's C library where it is glibc (platform.libc_ver reads the interpreter's binary: once)."""
    return ctypes.CDLL(None) if platform.libc_ver()[0] == "glibc" else None


@functools.cache
def keep_freed_memory() -> bool:
    """Set SETTINGS in this process's glibc malloc, once; whether they are in force."""
    libc = _glibc()
    return libc is not None and all(libc.mallopt(param, value) == 1 for param, value in SETTINGS.items())


def release_free_memory() -> None:
    """Give the memory this process has freed back to the OS (glibc's malloc_trim); a no-op elsewhere."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
