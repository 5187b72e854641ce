"""Fixtures for the WGSL emitter tests: one shared device (``get_device()`` is cached per
process) and a runner that emits, dispatches and reads back one kernel."""

import os
import tempfile

import pytest

os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.mkdtemp(prefix="mn-xdg-"))

from meganeura.errors import DeviceError  # noqa: E402

from ._util import Runner  # noqa: E402


@pytest.fixture(scope="session")
def dev():
    from meganeura.runtime.device import get_device

    try:
        return get_device()
    except DeviceError as e:  # pragma: no cover - CI has lavapipe
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no WebGPU adapter: {e}")


@pytest.fixture(scope="session")
def run(dev):
    return Runner(dev)


@pytest.fixture
def rng(request):
    import zlib

    import numpy as np

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
