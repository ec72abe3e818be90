"""Unit and end-to-end tests, imported as fastgen.tests.* (see the repository's conftest.py)."""

from fastgen import toplevel

if toplevel.is_bare(__name__):  # imported as bare `tests` from the repository root: see fastgen/toplevel.py
    toplevel.hand_over(__name__, __file__)
