"""Shared helpers of the transformer model tests: gates (DESIGN.md §5), gradient sessions."""

from __future__ import annotations

import numpy as np

import meganeura as mn

FWD_TOL = 1e-4  # strict: relative L2 of outputs/loss
BWD_TOL = 1e-3  # strict: relative L2 of every parameter gradient


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


def grad_session(graph, loss, outputs, backend=None):
    """A session computing ``outputs``, the loss and every parameter gradient (``grad:<name>``)
    in one run — gradients read straight from the device, no optimizer involved."""
    g2, grads = mn.grad(graph, loss)
    outs = {k: g2[v] for k, v in outputs.items()}
    outs["loss"] = g2[loss]
    outs.update({f"grad:{k}": v for k, v in grads.items()})
    return mn.compile(g2, outputs=outs, backend=backend)


def check_gates(ours: dict, fwd: dict, grads: dict, fwd_tol=FWD_TOL, bwd_tol=BWD_TOL):
    """Assert the forward gate on each ``fwd`` entry and the backward gate on every gradient;
    returns (worst forward error, worst gradient error) for the record."""
    worst_f = 0.0
    for k, ref in fwd.items():
        e = rel_l2(ours[k], ref)
        worst_f = max(worst_f, e)
        assert e <= fwd_tol, f"forward {k}: rel L2 {e:.3g} > {fwd_tol}"
    missing = sorted(set(grads) - {k[5:] for k in ours if k.startswith("grad:")})
    assert not missing, f"no gradient for {missing}"
    worst_b = 0.0
    for k, ref in grads.items():
        e = rel_l2(ours[f"grad:{k}"], ref)
        worst_b = max(worst_b, e)
        assert e <= bwd_tol, f"grad {k}: rel L2 {e:.3g} > {bwd_tol}"
        assert cosine(ours[f"grad:{k}"], ref) >= 0.999, k
    return worst_f, worst_b
