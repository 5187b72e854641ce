"""Graph → graph passes, applied in order by ``PIPELINE`` before scheduling.

``PIPELINE`` holds only passes that take a Program and return a rewritten Program (composite
ops expanded into primitives, algebraic simplification).  Decisions the scheduler makes while
it lowers the graph to kernels (which values get a buffer of their own) are not passes: they
live next to it, in ``compile/fusion.py``."""

from .expand import expand_composites
from .simplify import simplify

PIPELINE = [expand_composites, simplify]


def run_pipeline(program, debug: bool = False):
    for p in PIPELINE:
        program = p(program)
        if debug:
            print(f"--- after {p.__name__} ---\n{program.graph}")
    return program
