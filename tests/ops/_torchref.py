"""Shared helpers for the op tests: build an op in a fresh graph, evaluate it with the numpy
reference in float64, and compare forward values and VJPs with PyTorch (CPU, float64), and
gradients with central finite differences on the reference.

Tolerances are the acceptance gates: PyTorch ``<= 1e-10`` and finite differences ``<= 1e-6``,
both as relative L2 error (``||ours - theirs|| / ||theirs||``; absolute when theirs is zero)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

import meganeura as mn
from meganeura.autodiff import grad
from meganeura.reference import evaluate

TORCH_TOL = 1e-10
FD_TOL = 1e-6
FD_STEP = 1e-6

_NP_OF = {mn.f32: np.float64, mn.i32: np.int32, mn.bool_: np.bool_}


def rel_err(ours, theirs) -> float:
    """Relative L2 error of ``ours`` against ``theirs`` (absolute if ``theirs`` is all zero)."""
    a = np.asarray(ours, dtype=np.float64)
    b = np.asarray(theirs, dtype=np.float64)
    assert a.shape == b.shape, f"shape {a.shape} != expected {b.shape}"
    # non-finite entries must agree exactly (same NaN/±inf pattern); the rest is compared in L2
    assert np.array_equal(np.isnan(a), np.isnan(b)), f"NaN pattern differs: {a} vs {b}"
    inf = np.isinf(b)
    assert np.array_equal(a[inf], b[inf]) and not np.isinf(a[~inf]).any(), \
        f"infinities differ: {a} vs {b}"
    ok = np.isfinite(b)
    a, b = a[ok], b[ok]
    nb = float(np.linalg.norm(b))
    d = float(np.linalg.norm(a - b))
    return d if nb == 0.0 else d / nb


def assert_close(ours, theirs, tol: float, what: str = "") -> None:
    e = rel_err(ours, theirs)
    assert e <= tol, f"{what}: relative error {e:.3e} > {tol:.0e}"


# ---------------------------------------------------------------------------------- inputs

def rand(rng: np.random.Generator, shape, domain: str = "any") -> np.ndarray:
    """Random float64 array on a domain chosen away from the op's non-differentiable points."""
    shape = tuple(shape)
    if domain == "any":
        return rng.standard_normal(shape)
    if domain == "pos":  # strictly positive, away from 0
        return rng.uniform(0.5, 2.0, shape)
    if domain == "away0":  # |x| in [0.2, 2], random sign
        return rng.uniform(0.2, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
    if domain == "unit":
        return rng.uniform(-0.9, 0.9, shape)
    if domain == "nonint":  # away from integers (floor)
        return rng.integers(-3, 3, shape) + rng.uniform(0.1, 0.9, shape)
    if domain == "distinct":  # well-separated distinct values (max/min, sorting ties away)
        n = int(np.prod(shape, dtype=np.int64))
        vals = rng.permutation(n).astype(np.float64) * 0.37 - 0.1 * n
        return (vals + rng.uniform(-0.05, 0.05, n)).reshape(shape)
    raise ValueError(domain)


# ---------------------------------------------------------------------------------- checking

class Spec:
    """One operand: its array and whether it is a differentiable parameter."""

    def __init__(self, array, diff: bool | None = None):
        self.array = np.asarray(array)
        if self.array.dtype == np.float64:
            self.dtype = mn.f32
        elif self.array.dtype == np.bool_:
            self.dtype = mn.bool_
        else:
            self.array = self.array.astype(np.int32)
            self.dtype = mn.i32
        self.diff = self.dtype.is_float if diff is None else diff


def _as_spec(x) -> Spec:
    return x if isinstance(x, Spec) else Spec(x)


def _tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _build(build, specs: Sequence[Spec]):
    g = mn.Graph("test")
    vals = []
    for i, s in enumerate(specs):
        name = f"x{i}"
        if s.diff:
            vals.append(g.param(name, s.array.shape, s.dtype))
        else:
            vals.append(g.input(name, s.array.shape, s.dtype))
    outs = _tuple(build(*vals))
    env = {f"x{i}": s.array for i, s in enumerate(specs)}
    return g, vals, outs, env


def _torch_leaves(specs: Sequence[Spec]):
    ts = []
    for s in specs:
        if s.dtype.is_float:
            ts.append(torch.tensor(s.array, dtype=torch.float64, requires_grad=s.diff))
        elif s.dtype is mn.bool_:
            ts.append(torch.tensor(s.array, dtype=torch.bool))
        else:
            ts.append(torch.tensor(s.array.astype(np.int64)))
    return ts


def check_forward(build: Callable, torch_fn: Callable, *inputs, tol: float = TORCH_TOL):
    """Forward values (and output dtypes/shapes) against PyTorch."""
    specs = [_as_spec(x) for x in inputs]
    g, _, outs, env = _build(build, specs)
    ours = evaluate(g, list(outs), env, dtype=np.float64)
    theirs = _tuple(torch_fn(*_torch_leaves(specs)))
    assert len(ours) == len(theirs)
    for o, v, t in zip(ours, outs, theirs, strict=True):
        t = t.detach().numpy(force=True)
        assert o.shape == v.shape == t.shape, (o.shape, v.shape, t.shape)
        if v.dtype.is_float:
            assert o.dtype == np.float64
            assert_close(o, t, tol, "forward")
        else:
            assert o.dtype == v.dtype.np
            np.testing.assert_array_equal(o, t.astype(o.dtype))
    return ours


def _loss_graph(build, specs: Sequence[Spec], rng):
    """Graph with loss = Σ_i sum(out_i * ct_i), the cotangents fed as inputs."""
    g, vals, outs, env = _build(build, specs)
    loss = None
    cts = []
    for i, o in enumerate(outs):
        ct = g.input(f"ct{i}", o.shape)
        env[f"ct{i}"] = rng.standard_normal(o.shape)
        cts.append(env[f"ct{i}"])
        term = (o * ct).sum()
        loss = term if loss is None else loss + term
    return g, vals, outs, env, loss, cts


def check_op(build: Callable, torch_fn: Callable, *inputs, seed: int = 0, fd: bool = True,
             tol: float = TORCH_TOL, fd_tol: float = FD_TOL):
    """Forward and VJP against PyTorch, and the VJP against central finite differences."""
    specs = [_as_spec(x) for x in inputs]
    check_forward(build, torch_fn, *specs, tol=tol)
    rng = np.random.default_rng(1000 + seed)
    g, vals, outs, env, loss, cts = _loss_graph(build, specs, rng)
    names = [f"x{i}" for i, s in enumerate(specs) if s.diff]
    if not names:
        return
    g2, grads = grad(g, loss, wrt=names)
    ours = evaluate(g2, [grads[n] for n in names], env, dtype=np.float64)
    for n, o in zip(names, ours, strict=True):
        assert o.shape == g.params[n].shape and o.dtype == np.float64

    # PyTorch's VJP with the same cotangents
    ts = _torch_leaves(specs)
    touts = _tuple(torch_fn(*ts))
    tdiff = [t for t, s in zip(ts, specs, strict=True) if s.diff]
    pairs = [(t, torch.tensor(c, dtype=torch.float64)) for t, c in zip(touts, cts, strict=True)
             if t.requires_grad]
    if pairs:
        tg = torch.autograd.grad([p[0] for p in pairs], tdiff, [p[1] for p in pairs],
                                 allow_unused=True)
    else:  # e.g. a detached output: no gradient at all
        tg = [None] * len(tdiff)
    for n, o, t, x in zip(names, ours, tg, tdiff, strict=True):
        t = np.zeros(x.shape) if t is None else t.numpy(force=True)
        assert_close(o, t, tol, f"VJP wrt {n} vs torch")

    if fd:
        numeric = finite_difference(g, loss, env, names)
        for n, o in zip(names, ours, strict=True):
            assert_close(o, numeric[n], fd_tol, f"VJP wrt {n} vs finite differences")


def finite_difference(g, loss, env: Mapping[str, np.ndarray], names, h: float = FD_STEP):
    """Central differences of the scalar ``loss`` on the float64 reference, element by element."""
    env = {k: np.array(v, copy=True) for k, v in env.items()}
    out = {}
    for n in names:
        x = env[n]
        d = np.zeros(x.shape)
        flat, dflat = x.reshape(-1), d.reshape(-1)
        for i in range(flat.size):
            old = flat[i]
            flat[i] = old + h
            (fp,) = evaluate(g, [loss], env, dtype=np.float64)
            flat[i] = old - h
            (fm,) = evaluate(g, [loss], env, dtype=np.float64)
            flat[i] = old
            dflat[i] = (float(fp) - float(fm)) / (2 * h)
        out[n] = d
    return out


def second_order(build: Callable, torch_fn: Callable, *inputs, seed: int = 0,
                 tol: float = TORCH_TOL):
    """Gradient of <VJP, v> (a Hessian-vector product): grad applied to grad's own graph."""
    specs = [_as_spec(x) for x in inputs]
    rng = np.random.default_rng(2000 + seed)
    g, vals, outs, env, loss, cts = _loss_graph(build, specs, rng)
    names = [f"x{i}" for i, s in enumerate(specs) if s.diff]
    g1, grads = grad(g, loss, wrt=names)
    vs = []
    l2 = None
    for i, n in enumerate(names):
        v = g1.input(f"v{i}", grads[n].shape)
        env[f"v{i}"] = rng.standard_normal(grads[n].shape)
        vs.append(env[f"v{i}"])
        term = (grads[n] * v).sum()
        l2 = term if l2 is None else l2 + term
    g2, grads2 = grad(g1, l2, wrt=names)
    ours = evaluate(g2, [grads2[n] for n in names], env, dtype=np.float64)

    ts = _torch_leaves(specs)
    touts = _tuple(torch_fn(*ts))
    tdiff = [t for t, s in zip(ts, specs, strict=True) if s.diff]
    tl = sum((o * torch.tensor(c)).sum() for o, c in zip(touts, cts, strict=True))
    tg = torch.autograd.grad(tl, tdiff, create_graph=True, allow_unused=True)
    tl2 = sum((gi * torch.tensor(v)).sum() for gi, v in zip(tg, vs, strict=True) if gi is not None)
    if not isinstance(tl2, torch.Tensor) or not tl2.requires_grad:
        t2 = [None] * len(tdiff)
    else:
        t2 = torch.autograd.grad(tl2, tdiff, allow_unused=True)
    for n, o, t, x in zip(names, ours, t2, tdiff, strict=True):
        t = np.zeros(x.shape) if t is None else t.detach().numpy(force=True)
        assert_close(o, t, tol, f"second-order wrt {n} vs torch")
