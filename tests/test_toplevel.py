"""No folder of ours is importable under its bare name: from the repository root (on sys.path whenever Python runs
there) a third-party `import kernels` gets the installed `kernels`, and `import server` without one fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastgen.toplevel import FOLDERS

ROOT = Path(__file__).resolve().parent.parent


def run_from_root(code: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)  # after the root ('' for -c) on sys.path, as site-packages are
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_folders_listed_are_the_packages_of_the_root():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"fastgen"}
    assert packages == set(FOLDERS)


def test_test_modules_are_imported_as_fastgen_tests():
    assert __name__ == "fastgen.tests.test_toplevel"
    assert "tests" not in sys.modules


def test_assertions_in_test_modules_are_rewritten():
    with pytest.raises(AssertionError) as failure:
        assert [1, 2] == [1, 3]
    assert "At index 1 diff" in str(failure.value)


def test_an_installed_package_named_like_a_folder_wins_from_the_root(tmp_path):
    """Packages named like each folder, installed (on PYTHONPATH, behind the root as site-packages are): a
    third-party import of each from the repository root gets the installed one, submodules included."""
    for name in FOLDERS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("ORIGIN = 'installed'\n")
        (tmp_path / name / "part.py").write_text("ORIGIN = 'installed part'\n")
    code = "; ".join(
        f"import {name}, {name}.part; assert ({name}.ORIGIN, {name}.part.ORIGIN) == ('installed', 'installed part')"
        for name in FOLDERS
    )
    done = run_from_root(code + "; print('ok')", pythonpath=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_no_folder_is_importable_by_its_bare_name_from_the_root():
    code = f"""
import importlib, pathlib
root = pathlib.Path.cwd().resolve()
for name in {FOLDERS!r}:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        assert f"fastgen.{{name}}" in str(e), e
        continue
    # some other distribution of that name is installed: it must be that one, not our folder
    assert root not in pathlib.Path(module.__file__).resolve().parents, module.__file__
print("ok")
"""
    done = run_from_root(code)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_transformers_hub_kernels_imports_from_the_root():
    """transformers 5.25 imports Hugging Face's `kernels` (the fresh-install failure this guards against)."""
    done = run_from_root("import transformers.integrations.hub_kernels, fastgen.kernels; print('ok')")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
