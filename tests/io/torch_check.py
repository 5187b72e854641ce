"""The importer's gates (issue 17): an imported model against PyTorch float32 on the CPU,
forward relative L2 ≤ 1e-5, every parameter gradient ≤ 1e-4."""

from __future__ import annotations

import numpy as np
import torch

import meganeura as mn

FWD_TOL = 1e-5
BWD_TOL = 1e-4


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _flat_outputs(out) -> dict[str, np.ndarray]:
    """PyTorch's outputs under the names the importer gives them."""
    from torch.utils import _pytree as pytree

    from meganeura.io.torch_import.importer import _name

    found = {}
    for path, leaf in pytree.tree_flatten_with_path(out)[0]:
        if isinstance(leaf, torch.Tensor):
            parts = [str(getattr(k, "idx", getattr(k, "key", getattr(k, "name", k))))
                     for k in path]
            found[_name(parts)] = leaf.detach().numpy()
    return found


def _grad_error(ours, ref, all_ref) -> float:
    """Relative L2 error of one gradient; a gradient that is zero in exact arithmetic (a key
    bias under softmax: rounding noise of size 1e-9 in both) is measured against the whole
    model's gradient norm instead, where noise is noise."""
    scale = np.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in all_ref.values()))
    if np.linalg.norm(ref) < 1e-5 * scale:
        return float(np.linalg.norm(np.asarray(ours, np.float64) - ref) / max(scale, 1e-30))
    return rel_l2(ours, ref)


def gates(module, inputs: tuple, loss, targets: tuple, backend=None, device=None,
          fwd_tol=FWD_TOL, bwd_tol=BWD_TOL):
    """Import ``module`` with ``loss``, compute outputs, loss and every parameter gradient in
    one run, and compare them with PyTorch's; returns (worst forward, worst gradient error)
    and the imported model."""
    tm = mn.from_torch(module, inputs, loss=loss, loss_inputs=targets)
    g2, grads = mn.grad(tm.graph, tm.loss)
    outs = {k: g2[v] for k, v in tm.outputs.items()}
    outs["__loss"] = g2[tm.loss]
    outs.update({f"grad:{k}": v for k, v in grads.items()})
    kw = {"device": device} if device is not None else {}
    sess = mn.compile(g2, outputs=outs, backend=backend, **kw)
    sess.set_params(tm.weights)
    feeds = {n: t.numpy() for n, t in zip(tm.inputs, inputs + targets)}
    ours = sess.run(**feeds)

    module.zero_grad()
    out = module(*inputs)
    ref_loss = loss(out, *targets)
    ref_loss.backward()
    fwd = {**_flat_outputs(out), "__loss": ref_loss.detach().numpy()}
    assert set(fwd) == set(tm.outputs) | {"__loss"}, (sorted(fwd), sorted(tm.outputs))
    errs_f = {k: rel_l2(ours[k], v) for k, v in fwd.items()}
    # `not e <= tol`: a NaN error (inf or NaN outputs) fails instead of comparing False
    assert all(e <= fwd_tol for e in errs_f.values()), f"forward gate {fwd_tol}: {errs_f}"
    ref_grads = {k: p.grad.numpy() for k, p in module.named_parameters() if p.grad is not None}
    assert set(ref_grads) <= set(grads), sorted(set(ref_grads) - set(grads))
    errs_b = {k: _grad_error(ours[f"grad:{k}"], g, ref_grads) for k, g in ref_grads.items()}
    bad = {k: e for k, e in errs_b.items() if not e <= bwd_tol}
    assert not bad, f"gradient gate {bwd_tol}: {bad}"
    return max(errs_f.values()), max(errs_b.values()), tm
