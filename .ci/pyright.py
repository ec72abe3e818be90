#!/usr/bin/env python3
"""Runs pyright over FastGen as the package `fastgen`: `python .ci/pyright.py [pyright args] [paths]`, with the
config .ci/pyrightconfig.json (no paths: the folders it includes).

The repository root is the package `fastgen` only through setuptools' package-dir mapping (`fastgen.replica` is
`replica/`, `fastgen.toplevel` is `fastgen/toplevel.py`), and the editable install maps it with an import hook that
pyright cannot read. So this builds, in a temporary folder, the tree an ordinary install would have: `fastgen/` holding
symlinks to the entries of the repository's `fastgen/` and to each top-level folder that is a package (has an
`__init__.py`), puts the config at its root and runs pyright there. Relative imports (`from ..proto import ...`) and
absolute ones (`fastgen.proto.fastgen_pb2`) then resolve as they do at run time. Paths in pyright's output (text or
--outputjson) are rewritten from the tree back to the repository's files.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / ".ci" / "pyrightconfig.json"


def build_tree(root: Path) -> dict[str, str]:
    """Links root/fastgen/<name> to the repository's files; returns {tree path: repository path} per link."""
    package = root / "fastgen"
    package.mkdir()
    links: dict[Path, Path] = {}
    for entry in sorted((REPO / "fastgen").iterdir()):
        if entry.name != "__pycache__":
            links[package / entry.name] = entry
    for folder in sorted(REPO.iterdir()):
        if folder.is_dir() and folder.name != "fastgen" and (folder / "__init__.py").is_file():
            links[package / folder.name] = folder
    for link, target in links.items():
        link.symlink_to(target, target_is_directory=target.is_dir())
    shutil.copy(CONFIG, root / "pyrightconfig.json")
    return {str(link): str(target) for link, target in links.items()}


def tree_arg(arg: str, links: dict[str, str]) -> str:
    """A repository path given on the command line (`replica/engine.py`) as its path in the tree; others as they are."""
    path = Path(arg).resolve()
    if arg.startswith("-") or not path.exists():
        return arg
    for link, target in links.items():
        if path.is_relative_to(target):
            return str(Path(link) / path.relative_to(target))
    return str(path)  # pyright runs in the tree: a path outside the package, absolute


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="fastgen-pyright-") as tmp:
        root = Path(tmp).resolve()
        links = build_tree(root)
        # A link's path, ended by a separator or the end of the path (`fastgen/test` must not match `fastgen/tests`).
        pattern = re.compile("(?:" + "|".join(map(re.escape, links)) + r")(?![\w.-])")
        # --pythonpath: this interpreter's site-packages (torch, grpc, ...), whatever `python` is on PATH.
        args = ["--pythonpath", sys.executable, *(tree_arg(a, links) for a in sys.argv[1:])]
        proc = subprocess.Popen([sys.executable, "-m", "pyright", *args], cwd=root, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(pattern.sub(lambda m: links[m.group()], line))
        return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
