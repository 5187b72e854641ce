"""Fixtures for the WGSL emitter tests: one shared device (``get_device()`` is cached per
process) and a runner that emits, dispatches and reads back one kernel."""

import os
import tempfile

import pytest

os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.mkdtemp(prefix="mn-xdg-"))


from ._util import Runner  # noqa: E402


@pytest.fixture(scope="session")
def dev(gpu):
    """The shared device (tests/conftest.py); a missing adapter fails, it never skips."""
    return gpu


@pytest.fixture(scope="session")
def run(dev):
    return Runner(dev)


@pytest.fixture
def rng(request):
    import zlib

    import numpy as np

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
