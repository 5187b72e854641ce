import os
import tempfile

import pytest

os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.mkdtemp(prefix="mn-xdg-"))
# the suite never reads or writes the user's tuning cache (compiles stay deterministic)
os.environ.setdefault("MEGANEURA_TUNE_CACHE",
                      os.path.join(tempfile.mkdtemp(prefix="mn-tune-"), "tuning.json"))


@pytest.fixture(scope="session")
def gpu():
    """The process-wide WebGPU device (lavapipe in CI)."""
    from meganeura.runtime.device import get_device

    return get_device()
