"""Collects tests/ as the package fastgen.tests, never as a top-level `tests` (see fastgen/toplevel.py).

pytest names a test module after its path (tests/test_engine.py would be `tests.test_engine`) and imports its
package's `__init__.py` as `tests`. Here the folder is collected as a plain directory and each module imported by
its installed name, so the test run imports exactly what `import fastgen.tests...` does; a module found elsewhere
than the file collected (a non-editable install beside this checkout) is a collection error, not a silent mix.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent / "tests"

pytest_plugins = ["fastgen.tests.fixtures"]


class InstalledNameModule(pytest.Module):
    """A test module imported as fastgen.tests.<stem>."""

    def _getobj(self):
        name = f"fastgen.tests.{self.path.stem}"
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise self.CollectError(f"ImportError while importing test module {name}: {e!r}") from e
        if Path(module.__file__).resolve() != self.path.resolve():
            raise self.CollectError(
                f"{name} was imported from {module.__file__}, not from the collected {self.path}: "
                "install this checkout with `pip install -e .`"
            )
        self.config.pluginmanager.consider_module(module)
        return module


@pytest.hookimpl(tryfirst=True)
def pytest_collect_directory(path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if path.resolve() == TESTS:
        return pytest.Dir.from_parent(parent, path=path)  # not a Package: that would import tests/__init__.py
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    if module_path.resolve().parent == TESTS:
        return InstalledNameModule.from_parent(parent, path=module_path)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The `cuda` marker's skip, in one place: a test marked cuda needs a CUDA device, unless marked
    cuda(interpreted=True) (Triton kernels run under TRITON_INTERPRET=1 on a CPU, compiled on a GPU)."""
    import torch

    if torch.cuda.is_available():
        return
    needs_device = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        marker = item.get_closest_marker("cuda")
        if marker is not None and not marker.kwargs.get("interpreted", False):
            item.add_marker(needs_device)
