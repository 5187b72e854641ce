"""Whole training steps with the vec4 elementwise kernels: the same bits as with every
elementwise kernel forced to one element per invocation, and the reference backend's numbers.
The optimizer's flat in-place update and the activations' chains are the kernels that change."""

import numpy as np
import pytest

import meganeura as mn
from meganeura import optim
from meganeura.kernels import pointwise as pw
from meganeura.models.llama import llama_lm, tiny_llama
from meganeura.models.mlp import mlp_classifier
from meganeura.runtime.profile import shown_label


def _mlp(backend, gpu):
    m = mlp_classifier(8, in_dim=12, hidden=(16,), classes=5, activation="gelu")
    s = mn.compile(m.graph, loss=m.loss, optimizer=optim.AdamW(lr=1e-2, weight_decay=0.1),
                   backend=backend, **({"device": gpu} if backend != "reference" else {}))
    r = np.random.default_rng(0)
    feeds = [{"x": r.normal(size=(8, 12)).astype(np.float32),
              "y": r.integers(0, 5, 8).astype(np.int32)} for _ in range(2)]
    return s, feeds


def _llama(backend, gpu):
    m = llama_lm(tiny_llama(), 1, 8)
    s = mn.compile(m.graph, loss=m.loss, optimizer=optim.SGD(lr=0.05, momentum=0.9),
                   backend=backend, **({"device": gpu} if backend != "reference" else {}))
    r = np.random.default_rng(1)
    feeds = [{"ids": r.integers(0, 64, (1, 8)).astype(np.int32),
              "labels": r.integers(0, 64, (1, 8)).astype(np.int32)} for _ in range(2)]
    return s, feeds


def _train(make, backend, gpu):
    s, feeds = make(backend, gpu)
    s.init_params(seed=2)
    losses = [float(s.step(**f).loss) for f in feeds]
    return s, losses, s.get_params()


@pytest.mark.parametrize("make", [_mlp, _llama], ids=["mlp-adamw-gelu", "llama-sgd-momentum"])
def test_training_step_vec4_matches_scalar_bits_and_reference(gpu, monkeypatch, make):
    vec, lv, pv = _train(make, "wgpu", gpu)
    n_vec = sum(n for v, n in vec.kernel_variants()["train"].items() if v.startswith(
        "pointwise_x4"))
    assert n_vec >= 2, vec.kernel_variants()  # the update and activation kernels at least
    shown = [(d.label, shown_label(d)) for d in vec.train.stream.dispatches
             if d.variant == "pointwise_x4"]  # `pointwise[2]x4 (…)`, `copy x4 (…)`
    assert len(shown) == n_vec and all(
        s.replace("x4", "", 1).replace("  ", " ") == lb for lb, s in shown), shown
    with monkeypatch.context() as mp:
        mp.setattr(pw, "choose_config", lambda modes, total: pw.SCALAR)
        sc, ls, ps = _train(make, "wgpu", gpu)
    assert not any(v.startswith("pointwise_x") for v in sc.kernel_variants()["train"])
    assert lv == ls
    for name in pv:
        np.testing.assert_array_equal(pv[name], ps[name], err_msg=name)
    _, lr, pr = _train(make, "reference", gpu)
    np.testing.assert_allclose(lv, lr, rtol=1e-4)
    for name in pv:
        scale = float(np.abs(pr[name]).max()) or 1.0
        assert float(np.abs(pv[name] - pr[name]).max()) <= 1e-4 * scale, name
