"""The paper's methodology on this project and its baselines."""

from fastgen import toplevel

if toplevel.is_bare(__name__):  # imported as bare `benchmarks` from the repository root: see fastgen/toplevel.py
    toplevel.hand_over(__name__, __file__)
