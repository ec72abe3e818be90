"""README.md and docs/: every relative link resolves (files, and `#anchors` to headings as GitHub slugs them), the
README stays short and keeps the two commands CI runs, and no page names a path of one machine."""

from __future__ import annotations

import re
import runpy
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_BYTES = 16 * 1024

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)
# Paths that exist on one machine only: a page that names one sends the reader nowhere.
MACHINE_PATH = re.compile(r"/work/|/root/|/home/[^/\s`'\"]+/|/tmp/pytest")


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where `[a](b)` is not a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower-cased, without punctuation but `-` and `_`, spaces
    turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading slugs as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor in the page, repeats numbered as GitHub numbers them (`name`, `name-1`, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for match in HEADING.finditer(FENCE.sub("", page.read_text())):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(prose(page.read_text()))]


def relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)  # http:, https:, mailto:, ...


def test_docs_exist():
    names = {p.name for p in PAGES}
    for page in ("architecture.md", "deploy.md", "kubernetes.md", "clients.md", "security.md", "metrics.md"):
        assert page in names
    for page in ("scheduling.md", "models.md", "developing.md", "benchmarking.md", "gpu.md"):
        assert page in names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in filter(relative, links(page)):
        path, _, anchor = target.partition("#")
        file = (page.parent / unquote(path)).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and unquote(anchor).lower() not in anchors(file):
            broken.append(f"{target}: no heading with that anchor in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)} has broken links:\n" + "\n".join(broken)


def test_links_are_found():
    """The link pattern itself: the README links to every page of docs/."""
    targets = {t.partition("#")[0] for t in links(README)}
    missing = {f"docs/{p.name}" for p in PAGES[1:]} - targets
    assert not missing, f"README links to none of {sorted(missing)}"


def test_slugs_follow_github():
    assert slug("Tensor parallelism: `--tp K`") == "tensor-parallelism---tp-k"
    assert slug("Streams survive a replica's death") == "streams-survive-a-replicas-death"
    assert slug("SLA attainment, live") == "sla-attainment-live"
    assert slug("GPU profile (when a GPU machine is lent)") == "gpu-profile-when-a-gpu-machine-is-lent"
    assert slug("The engine from Python: `pipeline`") == "the-engine-from-python-pipeline"


def test_readme_is_short():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, over {README_MAX_BYTES}: move detail to docs/"


def test_readme_has_the_two_commands_ci_runs():
    readme = README.read_text()
    for heading in ("Run it", "Test it"):
        assert readme.count(f"\n{heading} ") == 1, f"README needs exactly one paragraph starting {heading!r}"
    command = runpy.run_path(str(ROOT / ".ci" / "readme_command.py"))["command"]
    run, test = command(readme, "run"), command(readme, "test")
    assert run.startswith("pip install ") and "fastgen-deploy start" in run
    assert test.startswith("pip install ") and " && python -m pytest -q" in test


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_machine_paths(page: Path):
    found = [
        f"line {n}: {line.strip()}"
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if MACHINE_PATH.search(line)
    ]
    assert not found, f"{page.relative_to(ROOT)} names paths of one machine:\n" + "\n".join(found)
