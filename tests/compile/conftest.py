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
