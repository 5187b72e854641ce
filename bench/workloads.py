"""Benchmark workloads: our graph + its PyTorch twin with identical weights and inputs.

Each factory ``(quick, variant) -> Workload``; ``variant`` is "main" (the paper's sizes) or
"minlat" (batch / sequence / chunk 1).  ``quick`` gives tiny configs for lavapipe/CPU runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import meganeura as mn
from meganeura.init import init_leaves


@dataclass
class Workload:
    name: str
    graph: Any
    loss: Any
    outputs: dict
    feeds: dict  # numpy, by our input names
    params: dict  # numpy, our names (seed 0)
    torch_model: Callable[[], Any]
    torch_feeds: Callable[[Any], dict]
    torch_loss: Callable[[Any, dict], tuple]  # (module, feeds) -> (loss, {name: tensor})
    load_torch: Callable[[Any, dict], None]
    torch_grads: Callable[[Any], dict]


def _params(graph, seed=0):
    return {k: v for k, v in init_leaves(graph, seed).items() if k in graph.params}


def _named_twin_io():
    """Copy by parameter name (our names == the twin's state-dict names)."""
    import torch

    def load(m, params):
        sd = m.state_dict()
        with torch.no_grad():
            for k, v in params.items():
                sd[k].copy_(torch.from_numpy(np.asarray(v)).to(sd[k].dtype))

    def grads(m):
        return {k: p.grad.detach().double().cpu().numpy() for k, p in m.named_parameters()
                if p.grad is not None}
    return load, grads


def mlp(quick: bool, variant: str) -> Workload:
    """The digits MLP (also the harness's own smoke test in CI)."""
    import torch
    from torch import nn

    from meganeura.models.mlp import mlp_classifier

    batch = 1 if variant == "minlat" else 64
    hidden = (32,) if quick else (128,)
    m = mlp_classifier(batch, hidden=hidden)
    r = np.random.default_rng(0)
    feeds = {"x": r.random((batch, 64), dtype=np.float32),
             "y": r.integers(0, 10, batch).astype(np.int32)}

    class Twin(nn.Module):
        def __init__(self):
            super().__init__()
            sizes = (64, *hidden, 10)
            self.mlp = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

        def forward(self, x):
            for i, lin in enumerate(self.mlp):
                x = lin(x)
                if i < len(self.mlp) - 1:
                    x = torch.relu(x)
            return x

    def tloss(model, f):
        logits = model(f["x"])
        return nn.functional.cross_entropy(logits, f["y"]), {"logits": logits}

    load, grads = _named_twin_io()
    return Workload("mlp", m.graph, m.loss, {"logits": m.logits}, feeds, _params(m.graph), Twin,
                    lambda d: {"x": torch.from_numpy(feeds["x"]).to(d),
                               "y": torch.from_numpy(feeds["y"]).long().to(d)},
                    tloss, load, grads)


WORKLOADS: dict[str, Callable[..., Workload]] = {"mlp": mlp}
del mn
