"""The examples in examples/ run headless (lavapipe in CI) and do what their docstrings say."""

import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _run_example(name: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_host_render_loop_trains_and_draws_on_the_hosts_device(tmp_path):
    out = tmp_path / "frame.png"
    line = _run_example("host_render_loop.py", "--frames", "12", "--out", str(out))
    m = re.search(r"frames=(\d+) first_loss=([\d.]+) last_loss=([\d.]+)", line)
    assert m, line
    frames, first, last = int(m[1]), float(m[2]), float(m[3])
    assert frames == 12 and last < 0.8 * first
    img = matplotlib.image.imread(out)
    assert img.shape[:2] == (160, 320)
    colours = np.unique(img[..., :3].reshape(-1, 3), axis=0)
    assert len(colours) >= 12  # background plus (at least) one colour per bar
    # bars stand on the bottom left; the top right (no bar reaches it) stays background
    assert not np.allclose(img[-20, 15, :3], img[5, -5, :3])
