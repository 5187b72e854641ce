import numpy as np
import pytest

import meganeura as mn
from meganeura import optim
from meganeura.models.mlp import mlp_classifier


@pytest.fixture
def mlp_session():
    """A factory of small MLP classifier training sessions (AdamW with clipping)."""

    def make(hidden, **kw):
        m = mlp_classifier(32, in_dim=64, hidden=hidden, classes=10)
        s = mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                       optimizer=optim.AdamW(lr=1e-2, weight_decay=0.01, clip_grad_norm=5.0),
                       **kw)
        s.init_params(seed=1)
        return s

    return make


def assert_trains_alike(a, b, steps: int = 3, batch: int = 32, rtol: float = 1e-6,
                        atol: float = 1e-7, seed: int = 0) -> None:
    """Two digits-classifier sessions given the same random batches report the same losses
    and end with the same parameters and optimizer states."""
    r = np.random.default_rng(seed)
    for _ in range(steps):
        x = r.normal(size=(batch, 64)).astype(np.float32)
        y = r.integers(0, 10, batch).astype(np.int32)
        np.testing.assert_allclose(a.step(x=x, y=y).loss, b.step(x=x, y=y).loss, rtol=rtol)
    for k, v in b.get_state().items():
        np.testing.assert_allclose(a.get_state()[k], v, rtol=max(rtol, 1e-6), atol=atol,
                                   err_msg=k)
