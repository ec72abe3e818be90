"""Regenerates the Python stubs next to fastgen.proto: `python -m fastgen.proto.build`.

The proto is compiled under the virtual path fastgen/proto/, so the generated gRPC module imports
`fastgen.proto.fastgen_pb2` and needs no patching."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
STUBS = ("fastgen_pb2.py", "fastgen_pb2.pyi", "fastgen_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Compiles fastgen.proto into out_dir; returns the stub paths."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-Ifastgen/proto={HERE}",
            f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(HERE / "fastgen.proto"),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on fastgen.proto")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in STUBS:
            shutil.copy(Path(tmp) / "fastgen" / "proto" / name, out_dir / name)
    return [out_dir / n for n in STUBS]


if __name__ == "__main__":
    for path in generate(HERE):
        print(path, file=sys.stderr)
