"""Importing a script of bench/ (not a package) from the tests."""

import importlib
import os
import sys

BENCH = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "bench"))


def load_bench(name: str):
    """``bench/<name>.py`` as a module; its own imports of sibling scripts resolve while it
    loads (bench/ is on ``sys.path`` only for that)."""
    sys.path.insert(0, BENCH)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(BENCH)
