"""``meganeura train --model cnn``: the digits CNN (conv + GroupNorm + max pool) trains on the
GPU (lavapipe in CI) to >= 97% test accuracy with the CLI defaults (20 epochs, AdamW, seed 0),
in well under a minute."""

import time

from meganeura.cli import main
from meganeura.models.cnn import digits_cnn


def test_digits_cnn_graph():
    m = digits_cnn(4)
    assert m.x.shape == (4, 64) and m.logits.shape == (4, 10)
    ops = {n.op for n in m.graph.nodes}
    assert {"conv2d", "max_pool2d"} <= ops
    assert not m.graph.states  # no running statistics: one graph for training and evaluation


def test_train_cnn_reaches_97_percent_on_gpu(gpu, tmp_path, capsys):
    t0 = time.perf_counter()
    rc = main(["train", "--model", "cnn", "--quiet", "--out", str(tmp_path),
               "--min-accuracy", "0.97"])
    elapsed = time.perf_counter() - t0
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "test accuracy" in out
    assert (tmp_path / "cnn.safetensors").exists()
    assert elapsed < 60, f"{elapsed:.1f} s"
