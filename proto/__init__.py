"""The wire contract: fastgen.proto (package fastgen.v1) and the stubs generated from it."""

from fastgen import toplevel

if toplevel.is_bare(__name__):  # imported as bare `proto` from the repository root: see fastgen/toplevel.py
    toplevel.hand_over(__name__, __file__)
