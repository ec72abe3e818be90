"""A replica: the Dynamic SplitFuse engine, its model runner and its gRPC service.

`from fastgen.replica import pipeline` (defined in offline.py) loads lazily, so the pure-Python scheduler modules
import without torch."""


def __getattr__(name: str):
    if name in ("pipeline", "Pipeline", "Output"):
        from . import offline as module

        return getattr(module, name)
    raise AttributeError(f"module 'fastgen.replica' has no attribute {name!r}")


__all__ = ["pipeline", "Pipeline", "Output"]
