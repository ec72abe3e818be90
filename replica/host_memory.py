"""How a CPU replica's process keeps the memory its steps free.

Every forward pass on CPU allocates and frees activations of tens of megabytes (a prompt chunk's MLP output, the
logits of a decode batch). glibc's malloc hands such blocks back to the kernel once enough is free at the top of
the heap, or maps each one afresh, so the next step takes a page fault per 4 KiB page as it writes them again,
which costs more than the elementwise kernels that touch them. vLLM's CPU build preloads tcmalloc for the same
reason. Here glibc is told instead to serve blocks up to its largest threshold from the heap and to keep what is
freed, which makes every step after the first reuse warm pages."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

log = logging.getLogger("fastgen.replica")

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc refuses a larger mmap threshold on 64-bit hosts (HEAP_MAX_SIZE / 2); blocks above it are mapped as before.
MMAP_THRESHOLD_BYTES = 32 << 20
# Free memory at the top of the heap kept rather than returned; a step's activations stay well under it.
TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Sets glibc's thresholds for this process; False (and nothing changed) where the C library is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    kept = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    kept = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and kept
    if not kept:
        log.warning("glibc refused the malloc thresholds; CPU steps will page-fault their activations back in")
    return kept
