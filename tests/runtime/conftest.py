"""Runtime test fixtures: ``dev`` is the process-wide device (``get_device()`` is cached)."""

import os
import tempfile

import pytest

os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.mkdtemp(prefix="mn-xdg-"))


@pytest.fixture(scope="session")
def dev():
    from meganeura.errors import DeviceError
    from meganeura.runtime.device import get_device

    try:
        return get_device()
    except DeviceError as e:  # pragma: no cover - CI has lavapipe
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no WebGPU adapter: {e}")
