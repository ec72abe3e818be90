"""A replica: the Dynamic SplitFuse engine, its model runner and its gRPC service.

`from fastgen.replica import pipeline` (defined in offline.py) loads lazily, so the pure-Python scheduler modules
import without torch."""

from typing import TYPE_CHECKING

from fastgen import toplevel

if TYPE_CHECKING:  # what __getattr__ hands out, for type checkers
    from .offline import Output, Pipeline, pipeline

if toplevel.is_bare(__name__):  # imported as bare `replica` from the repository root: see fastgen/toplevel.py
    toplevel.hand_over(__name__, __file__)


def __getattr__(name: str):
    if name in ("pipeline", "Pipeline", "Output"):
        from . import offline as module

        return getattr(module, name)
    raise AttributeError(f"module 'fastgen.replica' has no attribute {name!r}")


__all__ = ["pipeline", "Pipeline", "Output"]
