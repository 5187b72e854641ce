"""Graph → graph passes, applied in order by ``PIPELINE``."""

from .expand import expand_composites
from .simplify import simplify

PIPELINE = [expand_composites, simplify]


def run_pipeline(program, debug: bool = False):
    for p in PIPELINE:
        program = p(program)
        if debug:
            print(f"--- after {p.__name__} ---\n{program.graph}")
    return program
