"""Finding the GPUs a deployment can use, without torch (the CLI must answer at once): nvidia-smi where it is
installed, else the driver's /proc entries, else none. CUDA_VISIBLE_DEVICES, when set, says which of them are ours.

`deployment.start` takes the finder as an argument, so tests pass their own list instead of probing the machine."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

PROC_GPUS = Path("/proc/driver/nvidia/gpus")


def count_gpus() -> int:
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            out = None
        if out is not None and out.returncode == 0:
            return sum(1 for line in out.stdout.splitlines() if line.strip())
    if PROC_GPUS.is_dir():
        return sum(1 for _ in PROC_GPUS.iterdir())
    return 0


def visible_gpus(environ: Mapping[str, str] = os.environ, count=count_gpus) -> list[str]:
    """The GPUs this launcher may hand out, as CUDA_VISIBLE_DEVICES entries: the ones that variable lists (CUDA
    stops at the first invalid entry, such as -1), else every GPU the machine has."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count())]
    gpus = []
    for entry in (e.strip() for e in listed.split(",")):
        if not entry or entry.startswith("-"):
            break
        gpus.append(entry)
    return gpus
