"""benchmarks/RESULTS.md's tables against the summaries they come from: every `<!-- table: NAME -->` block is rebuilt
by benchmarks/results_tables.py from the tracked summaries under benchmarks/results/ and must equal the report's
text, so a figure edited by hand, or a summary changed without regenerating the report, fails here. Regenerate with
`python -m fastgen.benchmarks.results_tables --write`."""

from __future__ import annotations

import pytest

from fastgen.benchmarks import results_tables

MAX_REPORT_BYTES = 40_000


@pytest.fixture(scope="module")
def report_text() -> str:
    if not results_tables.RESULTS_MD.exists():
        pytest.skip("benchmarks/RESULTS.md is not in this installation")
    return results_tables.RESULTS_MD.read_text()


def test_every_table_block_names_a_generator_and_every_generator_is_used(report_text):
    names = [m["name"] for m in results_tables.BLOCK.finditer(report_text)]
    assert len(names) == len(set(names)), "a table appears twice"
    assert set(names) == set(results_tables.TABLES), (
        f"blocks without a generator: {sorted(set(names) - set(results_tables.TABLES))}; "
        f"generators without a block: {sorted(set(results_tables.TABLES) - set(names))}"
    )
    # Every opening marker is matched by a closing one (an unclosed block would be silently skipped).
    assert report_text.count("<!-- table: ") == len(names) == report_text.count("<!-- /table -->")


@pytest.mark.parametrize("name", sorted(results_tables.TABLES))
def test_table_matches_the_summaries(report_text, name):
    written = results_tables.blocks(report_text).get(name)
    assert written is not None, f"RESULTS.md has no block for {name}"
    built = results_tables.TABLES[name]()
    assert written == built, (
        f"RESULTS.md's table {name!r} differs from what the summaries give; "
        "run `python -m fastgen.benchmarks.results_tables --write`\n--- written\n"
        f"{written}\n--- built\n{built}"
    )


def test_regenerating_changes_nothing(report_text):
    assert results_tables.rewrite(report_text) == report_text


def test_report_is_short_and_points_to_the_log(report_text):
    assert len(report_text.encode()) <= MAX_REPORT_BYTES
    assert "log/2026-lab-log.md" in report_text
    assert (results_tables.BENCH_DIR / "log" / "2026-lab-log.md").exists()


def test_ratios_are_medians_of_per_repeat_ratios():
    """The method's rule, on one figure issue 53 corrected: W2 at one thread is 1.77x (per repeat 2.01, 1.77, 1.74),
    where the ratio of the medians is 1.93x."""
    row = next(line for line in results_tables.offline_transformers().splitlines() if line.startswith("| W2 | 1 |"))
    assert "2.01, 1.77, 1.74" in row and "**1.77×**" in row and "1.93×" in row
