"""Issue gate: a 2-layer MLP on digits trained by the reference interpreter with AdamW reaches
>= 95% test accuracy with a fixed seed, in well under 60 s."""

import time

import numpy as np

import meganeura as mn
from meganeura import optim
from meganeura.io.datasets import batches, load_digits
from meganeura.models.mlp import mlp_classifier


def test_mlp_digits_reference_adamw_reaches_95_percent():
    t0 = time.perf_counter()
    xtr, ytr = load_digits("train")
    xte, yte = load_digits("test")
    m = mlp_classifier(64)
    sess = mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                      optimizer=optim.AdamW(lr=3e-3, weight_decay=0.01), backend="reference")
    sess.init_params(seed=0)
    first = None
    for epoch in range(20):
        for xb, yb in batches(xtr, ytr, 64, shuffle=True, seed=epoch, drop_last=True):
            r = sess.step(x=xb, y=yb)
            first = first if first is not None else r.loss
    me = mlp_classifier(len(xte))
    ev = mn.compile(me.graph, outputs={"logits": me.logits}, backend="reference")
    ev.set_params(sess.get_params())
    acc = float((ev.run(x=xte)["logits"].argmax(-1) == yte).mean())
    assert r.loss < 0.25 * first
    assert acc >= 0.95, acc
    assert time.perf_counter() - t0 < 60
    assert np.isfinite(r.loss)
