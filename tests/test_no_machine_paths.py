"""No tracked file names a path on one machine: commands and paths are recorded relative to the repository (or as
`~/...`, `<tmp>/...`), so a summary or a document reads the same on every checkout. Scans `git ls-files` (text files
only) for the patterns below; tests/ may hold such paths as test data and is left out."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATTERNS = re.compile(r"/work/|/root/|/home/[A-Za-z0-9._-]+/|/tmp/pytest")
ALLOWED_PREFIXES = ("tests/",)


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30
        ).stdout.decode()
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    return [f for f in out.split("\0") if f]


def offenders(files: list[str]) -> list[str]:
    found = []
    for name in files:
        if name.startswith(ALLOWED_PREFIXES):
            continue
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, or a submodule
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        text = data.decode("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            match = PATTERNS.search(line)
            if match:
                found.append(f"{name}:{number}: {match.group(0)} in {line.strip()[:120]}")
    return found


def test_no_tracked_file_holds_a_machine_path():
    found = offenders(tracked_files())
    assert not found, "machine paths in tracked files (write them relative to the repository):\n" + "\n".join(found)


def test_the_scan_finds_what_it_looks_for(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "a.json").write_text('{"raw": "' + "/wo" + 'rk/main/benchmarks/out/x.json"}\n')
    (tmp_path / "b.md").write_text("see ~/venv/bin and <tmp>/x and benchmarks/out/y\n")
    (tmp_path / "c.bin").write_bytes(b"\0/ro" + b"ot/x")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "d.py").write_text("'/ho" + "me/someone/x'\n")
    found = offenders(["a.json", "b.md", "c.bin", "tests/d.py"])
    assert len(found) == 1 and found[0].startswith("a.json:1:")
