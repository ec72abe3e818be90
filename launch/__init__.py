"""`fastgen-deploy`: starts, inspects and stops a persistent deployment and supervises it."""

from fastgen import toplevel

if toplevel.is_bare(__name__):  # imported as bare `launch` from the repository root: see fastgen/toplevel.py
    toplevel.hand_over(__name__, __file__)
