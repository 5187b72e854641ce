"""Runtime test fixtures: ``dev`` is the process-wide device (``get_device()`` is cached)."""

import os
import tempfile

import pytest

os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.mkdtemp(prefix="mn-xdg-"))


@pytest.fixture(scope="session")
def dev(gpu):
    """The shared device (tests/conftest.py); a missing adapter fails, it never skips."""
    return gpu
