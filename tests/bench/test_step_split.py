"""bench/step_split.py: a step's launch (host) and wait parts on resident feeds, and an idle
queue's sync round trip, on this device."""

import numpy as np

import meganeura as mn

from ._util import load_bench


def test_split_times_are_positive_and_add_up(gpu):
    ss = load_bench("step_split")
    g = mn.Graph("mm")
    x = g.input("x", (16, 24))
    w = g.param("w", (24, 8))
    sess = mn.compile(g, outputs={"y": (x @ w).relu()}, device=gpu)
    sess.set_params({"w": np.ones((24, 8), np.float32)})
    rec = ss.split_times(sess, True, {"x": np.ones((16, 24), np.float32)}, steps=2)
    assert rec["dispatches"] == len(sess.infer.commands) >= 1
    assert rec["launch_us"] > 0 and rec["wait_us"] > 0
    # medians of the parts need not add to the median of the sums, but cannot exceed it twice
    assert rec["wall_us"] <= 2 * (rec["launch_us"] + rec["wait_us"])
    assert ss.idle_sync_us(gpu, n=3) > 0
