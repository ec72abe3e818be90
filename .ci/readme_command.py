"""Prints one of README.md's two commands for a fresh machine, so CI runs exactly what a newcomer copies:
`run` (install, start, answer a request) or `test` (install, run the suite)."""

import re
import sys
from pathlib import Path

HEADINGS = {"run": "Run it", "test": "Test it"}


def command(readme: str, which: str) -> str:
    """The first ```bash block after the paragraph that starts with the heading's words."""
    start = readme.index(f"\n{HEADINGS[which]} ")
    block = re.search(r"```bash\n(.+?)\n```", readme[start:], re.S)
    lines = block.group(1).strip().splitlines()
    if len(lines) != 1:
        raise SystemExit(f"README's {which!r} command must be one line, found {len(lines)}")
    return lines[0]


if __name__ == "__main__":
    print(command((Path(__file__).resolve().parent.parent / "README.md").read_text(), sys.argv[1]))
