import os
import tempfile

import pytest

os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.mkdtemp(prefix="mn-xdg-"))


@pytest.fixture(scope="session")
def gpu():
    """The process-wide WebGPU device (lavapipe in CI)."""
    from meganeura.runtime.device import get_device

    return get_device()
