"""FastGen's folders are packages only as `fastgen.<folder>`, never as bare top-level names.

The folders sit at the repository root (`kernels/`, `server/`, ...), and the root is on `sys.path` whenever Python
runs from it (`python -m pytest`, `python -m fastgen...`, `python -c`). A bare `import kernels` there finds our
folder before the distribution of that name in site-packages (transformers 5.25 imports Hugging Face's `kernels`).
Each folder's `__init__.py` therefore runs its body only as `fastgen.<folder>`; imported under its bare name it
calls `hand_over`, which finishes the import as if the folder were not there: with the installed package of that
name, or with ModuleNotFoundError.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

FOLDERS = ("proto", "server", "balancer", "replica", "kernels", "launch", "tests", "benchmarks")


def is_bare(name: str) -> bool:
    """True when a folder's package was imported under its own name instead of `fastgen.<name>`."""
    return not name.startswith("fastgen.")


def hand_over(name: str, init_file: str) -> None:
    """Called by the `__init__.py` of our folder `name` when it is being imported as bare `name`: puts the module
    the import would have found without our folder into sys.modules, where the import statement takes it from
    (a module may replace itself there while it runs). Raises ModuleNotFoundError when there is none."""
    ours = Path(init_file).resolve().parent
    others = [entry for entry in sys.path if not _holds(entry, name, ours)]
    spec = None
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder:
            spec = importlib.machinery.PathFinder.find_spec(name, others)
        elif (find_spec := getattr(finder, "find_spec", None)) is not None:
            spec = find_spec(name, None)
        if spec is not None and _origin_dir(spec) != ours:
            break
        spec = None
    if spec is None:
        raise ModuleNotFoundError(
            f"No module named {name!r} (FastGen's {name}/ folder is the package fastgen.{name}, "
            f"never a top-level {name!r})",
            name=name,
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise


def _holds(entry: str, name: str, ours: Path) -> bool:
    try:
        return (Path(entry or ".") / name).resolve() == ours
    except OSError:
        return False


def _origin_dir(spec) -> Path | None:
    if spec.origin in (None, "built-in", "frozen"):
        return None
    return Path(spec.origin).resolve().parent
