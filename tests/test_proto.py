"""The committed stubs are exactly what the proto generates today."""

from pathlib import Path

from fastgen.proto.build import HERE, STUBS, generate


def test_committed_stubs_are_fresh(tmp_path: Path):
    for fresh in generate(tmp_path):
        committed = HERE / fresh.name
        assert committed.read_text() == fresh.read_text(), (
            f"{committed.name} is stale: run `python -m fastgen.proto.build` and commit the result"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(STUBS)


def test_every_field_is_commented():
    lines = (HERE / "fastgen.proto").read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith(("syntax", "package", "//"))
        if is_field:
            assert lines[i - 1].strip().startswith("//"), f"fastgen.proto line {i + 1} has no comment: {stripped}"
