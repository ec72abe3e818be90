"""Where a benchmark figure came from, recorded with every summary: the command, the commit, the date, the machine
(CPU model, cores, AMX or not: the machines differ between runs) and the load. Also where raw records go.

Raw records (per-request timings, per-round figures) go under benchmarks/out/, which git ignores; the tracked
summaries under benchmarks/results/ hold what RESULTS.md's tables are built from.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"  # tracked: small summaries and the plots RESULTS.md shows
RAW_DIR = BENCH_DIR / "out"  # ignored by git: raw per-request records


def git_commit() -> str:
    """Short HEAD, '+dirty' when tracked files differ from it (the numbers are then not HEAD's alone)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, cwd=BENCH_DIR
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=BENCH_DIR,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+dirty" if dirty else "")) or "unknown"


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine() -> dict:
    """CPU model, its family and model numbers (a virtual machine's model name may say only "AMD EPYC": family 25 is
    Zen 3/4, 26 Zen 5), cores this process may use, and the matrix/vector extensions the kernels choose by."""
    model, flags, numbers = platform.processor() or platform.machine(), set(), {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name":
                model = value.strip()
            elif key in ("cpu family", "model") and value.strip().isdigit():
                numbers["family" if key == "cpu family" else "model"] = int(value)
            elif key == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    found = {"cpu": model, "cores": cores(), "amx": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags}
    return found | numbers


def machine_name(m: dict | None = None) -> str:
    """'<CPU model> x <cores> (AMX, AVX512-BF16)': one line for a table."""
    m = m or machine()
    ext = [name for key, name in (("amx", "AMX"), ("avx512_bf16", "AVX512-BF16")) if m.get(key)]
    return f"{m['cpu']} x {m['cores']}" + (f" ({', '.join(ext)})" if ext else " (no AMX, no AVX512-BF16)")


def command(module: str, argv: list[str] | None = None) -> str:
    """The command line that reproduces a run: `python -m fastgen.benchmarks.<module> <args>`."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", "-m", f"fastgen.benchmarks.{module}", *map(str, args)])


def run_info(module: str, argv: list[str] | None = None) -> dict:
    """command, commit, date (UTC), machine, load average, python and torch versions."""
    info = {
        "command": command(module, argv),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "load": list(os.getloadavg()),
        "python": platform.python_version(),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
    return info


def default_raw(summary: Path, subfolder: str) -> Path:
    """Where raw records go for a summary: benchmarks/out/<subfolder>/<the summary's name>."""
    return RAW_DIR / subfolder / Path(summary).name
