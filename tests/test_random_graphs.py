"""Random small graphs (hypothesis): chains of elementwise, broadcasting, reduction, shape,
matmul and softmax ops ending in a loss.  Three implementations must agree on every graph:

- the numpy reference interpreter in float64 and PyTorch float64 autograd (loss and every
  parameter's gradient, ``mn.grad``), to 1e-9;
- the whole GPU path (passes, fusion, plan, WGSL on lavapipe) and the float64 reference, to f32
  accuracy (forward value, loss and gradients).

A graph is drawn as a recipe (a list of named steps, each with its meganeura and its torch
form), so a failure prints a readable program.  CI runs a fixed, derandomized set of examples;
``MEGANEURA_HYPOTHESIS_EXAMPLES=5000`` runs that many random ones (a fresh seed each run)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import meganeura as mn

_ON_DEMAND = os.environ.get("MEGANEURA_HYPOTHESIS_EXAMPLES")


def _settings(default: int):
    """``default`` derandomized examples in CI; the env var's count of random ones on demand."""
    n = int(_ON_DEMAND) if _ON_DEMAND else default
    return settings(max_examples=n, derandomize=not _ON_DEMAND, deadline=None,
                    database=None, print_blob=bool(_ON_DEMAND),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass
class Step:
    label: str
    mn: object  # (Value, params: dict[str, Value]) -> Value
    torch: object  # (Tensor, params: dict[str, Tensor]) -> Tensor


@dataclass
class Recipe:
    """A random program: an input parameter, a chain of steps, a loss."""

    shape: tuple[int, ...]
    params: dict[str, tuple[int, ...]] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    consts: dict[str, np.ndarray] = field(default_factory=dict)
    seed: int = 0

    def new_param(self, shape) -> str:
        name = f"p{len(self.params)}"
        self.params[name] = tuple(shape)
        return name

    def __str__(self) -> str:
        ps = ", ".join(f"{k}{list(v)}" for k, v in self.params.items())
        return f"params {ps}: " + " -> ".join(s.label for s in self.steps)


# ----------------------------------------------------------------------------- op tables

# shape-preserving unary ops; domains kept safe (log/sqrt/reciprocal of x^2 + c)
UNARY = {
    "neg": (lambda x: -x, lambda x: -x),
    "tanh": (lambda x: x.tanh(), torch.tanh),
    "sigmoid": (lambda x: x.sigmoid(), torch.sigmoid),
    "sin": (lambda x: x.sin(), torch.sin),
    "cos": (lambda x: x.cos(), torch.cos),
    "square": (lambda x: x.square(), torch.square),
    "silu": (lambda x: x.silu(), torch.nn.functional.silu),
    "gelu": (lambda x: x.gelu(), torch.nn.functional.gelu),
    "gelu_tanh": (lambda x: x.gelu("tanh"),
                  lambda x: torch.nn.functional.gelu(x, approximate="tanh")),
    "erf": (lambda x: x.erf(), torch.erf),
    "exp_tanh": (lambda x: x.tanh().exp(), lambda x: torch.exp(torch.tanh(x))),
    "expm1": (lambda x: mn.ops.expm1(x.tanh()), lambda x: torch.expm1(torch.tanh(x))),
    "log1p_sq": (lambda x: (x * x + 1.0).log(), lambda x: torch.log(x * x + 1.0)),
    "sqrt": (lambda x: (x * x + 0.5).sqrt(), lambda x: torch.sqrt(x * x + 0.5)),
    "rsqrt": (lambda x: (x * x + 1.0).rsqrt(), lambda x: torch.rsqrt(x * x + 1.0)),
    "recip": (lambda x: (x * x + 1.0).reciprocal(), lambda x: 1.0 / (x * x + 1.0)),
    "scale": (lambda x: 2.5 * x - 0.5, lambda x: 2.5 * x - 0.5),
    "pow3": (lambda x: x ** 3.0, lambda x: x ** 3.0),
}

# binary ops with a parameter operand (possibly broadcast)
BINARY = {
    "add": (lambda a, b: a + b, lambda a, b: a + b),
    "sub": (lambda a, b: b - a, lambda a, b: b - a),
    "mul": (lambda a, b: a * b, lambda a, b: a * b),
    "div": (lambda a, b: a / (b * b + 1.0), lambda a, b: a / (b * b + 1.0)),
    "maximum": (mn.ops.maximum, torch.maximum),
    "minimum": (mn.ops.minimum, torch.minimum),
    "pow": (lambda a, b: (a * a + 1.0) ** b.tanh(), lambda a, b: (a * a + 1.0) ** torch.tanh(b)),
    "where": (lambda a, b: mn.ops.where(a > b, a, b * 2.0),
              lambda a, b: torch.where(a > b, a, b * 2.0)),
}

REDUCE = {
    "sum": (lambda x, ax, k: x.sum(ax, keepdims=k), lambda x, ax, k: x.sum(ax, keepdim=k)),
    "mean": (lambda x, ax, k: x.mean(ax, keepdims=k), lambda x, ax, k: x.mean(ax, keepdim=k)),
    "max": (lambda x, ax, k: x.max(ax, keepdims=k), lambda x, ax, k: x.amax(ax, keepdim=k)),
    "min": (lambda x, ax, k: x.min(ax, keepdims=k), lambda x, ax, k: x.amin(ax, keepdim=k)),
    "logsumexp": (lambda x, ax, k: mn.ops.logsumexp(x, ax, keepdims=k),
                  lambda x, ax, k: torch.logsumexp(x, ax, keepdim=k)),
}


# ----------------------------------------------------------------------------- drawing


def _unary(draw, r: Recipe, shape):
    name = draw(st.sampled_from(sorted(UNARY)))
    f, t = UNARY[name]
    r.steps.append(Step(name, lambda x, p: f(x), lambda x, p: t(x)))
    return shape


def _binary(draw, r: Recipe, shape):
    name = draw(st.sampled_from(sorted(BINARY)))
    # the parameter's shape: the same, a suffix, or with some dims set to 1
    how = draw(st.sampled_from(["same", "suffix", "ones"]))
    if how == "suffix":
        pshape = shape[draw(st.integers(0, len(shape) - 1)):]
    elif how == "ones":
        pshape = tuple(1 if draw(st.booleans()) else d for d in shape)
    else:
        pshape = shape
    pn = r.new_param(pshape)
    f, t = BINARY[name]
    r.steps.append(Step(f"{name}({pn}{list(pshape)})", lambda x, p: f(x, p[pn]),
                        lambda x, p: t(x, p[pn])))
    return shape


def _reduce(draw, r: Recipe, shape):
    name = draw(st.sampled_from(sorted(REDUCE)))
    ax = draw(st.integers(0, len(shape) - 1))
    keep = len(shape) == 1 or draw(st.booleans())
    f, t = REDUCE[name]
    r.steps.append(Step(f"{name}(axis={ax}, keepdims={keep})", lambda x, p: f(x, ax, keep),
                        lambda x, p: t(x, ax, keep)))
    return shape[:ax] + ((1,) if keep else ()) + shape[ax + 1:]


def _center(draw, r: Recipe, shape):
    """x - mean(x, axis): a reduction broadcast back (norm-like), then a product."""
    ax = draw(st.integers(0, len(shape) - 1))
    r.steps.append(Step(f"center(axis={ax})",
                        lambda x, p: (x - x.mean(ax, keepdims=True)) * x,
                        lambda x, p: (x - x.mean(ax, keepdim=True)) * x))
    return shape


def _softmax(draw, r: Recipe, shape):
    ax = draw(st.integers(0, len(shape) - 1))
    if draw(st.booleans()):
        r.steps.append(Step(f"softmax({ax})", lambda x, p: mn.ops.softmax(x, ax),
                            lambda x, p: torch.softmax(x, ax)))
    else:
        r.steps.append(Step(f"log_softmax({ax})", lambda x, p: mn.ops.log_softmax(x, ax),
                            lambda x, p: torch.log_softmax(x, ax)))
    return shape


def _matmul(draw, r: Recipe, shape):
    k = draw(st.integers(1, 5))
    n = shape[-1]
    if draw(st.booleans()):
        pn = r.new_param((n, k))
        r.steps.append(Step(f"matmul({pn}[{n},{k}])", lambda x, p: x @ p[pn],
                            lambda x, p: x @ p[pn]))
    else:
        pn = r.new_param((k, n))
        r.steps.append(Step(f"matmul_tb({pn}[{k},{n}])",
                            lambda x, p: mn.ops.matmul(x, p[pn], transpose_b=True),
                            lambda x, p: x @ p[pn].transpose(-1, -2)))
    return shape[:-1] + (k,)


def _shape_op(draw, r: Recipe, shape):
    kind = draw(st.sampled_from(["reshape", "permute", "slice", "flip", "concat", "bcast"]))
    rank = len(shape)
    if kind == "permute" and rank >= 2:
        perm = tuple(draw(st.permutations(range(rank))))
        r.steps.append(Step(f"permute{perm}", lambda x, p: x.permute(*perm),
                            lambda x, p: x.permute(*perm)))
        return tuple(shape[i] for i in perm)
    if kind == "slice" and max(shape) >= 2:
        ax = max(range(rank), key=lambda a: shape[a])
        start = draw(st.integers(0, shape[ax] - 2))
        step = draw(st.integers(1, 2))
        r.steps.append(Step(f"slice(axis={ax}, {start}::{step})",
                            lambda x, p: mn.ops.slice_(x, ax, start, None, step),
                            lambda x, p: x.narrow(ax, start, shape[ax] - start)[
                                (slice(None),) * ax + (slice(None, None, step),)]))
        return shape[:ax] + (len(range(start, shape[ax], step)),) + shape[ax + 1:]
    if kind == "flip":
        ax = draw(st.integers(0, rank - 1))
        r.steps.append(Step(f"flip({ax})", lambda x, p: mn.ops.flip(x, ax),
                            lambda x, p: torch.flip(x, (ax,))))
        return shape
    if kind == "concat":
        ax = draw(st.integers(0, rank - 1))
        pshape = shape[:ax] + (draw(st.integers(1, 3)),) + shape[ax + 1:]
        pn = r.new_param(pshape)
        r.steps.append(Step(f"concat({pn}{list(pshape)}, axis={ax})",
                            lambda x, p: mn.ops.concat([x, p[pn]], ax),
                            lambda x, p: torch.cat([x, p[pn]], ax)))
        return shape[:ax] + (shape[ax] + pshape[ax],) + shape[ax + 1:]
    if kind == "bcast" and rank < 3:
        new = (2,) + shape
        r.steps.append(Step(f"broadcast_to{new} * 1.5",
                            lambda x, p: mn.ops.broadcast_to(x, new) * 1.5,
                            lambda x, p: torch.broadcast_to(x, new) * 1.5))
        return new
    new = _reshape_target(draw, shape)
    r.steps.append(Step(f"reshape{new}", lambda x, p: x.reshape(new), lambda x, p: x.reshape(new)))
    return new


def _reshape_target(draw, shape):
    """Flatten, or split the size into up to three factors."""
    n = int(np.prod(shape))
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    a = draw(st.sampled_from(divisors))
    if draw(st.booleans()) or a == n:
        return (n,) if a in (1, n) else (a, n // a)
    rest = n // a
    b = draw(st.sampled_from([d for d in range(1, rest + 1) if rest % d == 0]))
    return (a, b, rest // b)


STEP_KINDS = [_unary, _unary, _binary, _binary, _reduce, _center, _softmax, _matmul, _shape_op,
              _shape_op]


@st.composite
def recipes(draw, max_steps: int = 5):
    """A random program over small shapes (at most ~5^3 elements per value)."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    r = Recipe(shape)
    r.new_param(shape)
    for _ in range(draw(st.integers(1, max_steps))):
        if int(np.prod(shape)) > 150:
            break
        shape = draw(st.sampled_from(STEP_KINDS))(draw, r, shape)
    _loss(draw, r, shape)
    r.seed = draw(st.integers(0, 2**31 - 1))
    return r


def _loss(draw, r: Recipe, shape):
    rng = np.random.default_rng(len(r.steps))
    kind = draw(st.sampled_from(["weighted_sum", "mse", "bce", "xent"]))
    if kind == "xent":
        c = shape[-1]
        rows = int(np.prod(shape[:-1]))
        labels = rng.integers(0, c, rows).astype(np.int32)
        r.consts["labels"] = labels
        r.steps.append(Step(
            "cross_entropy",
            lambda x, p: mn.ops.cross_entropy(x.reshape(rows, c), p["labels"]),
            lambda x, p: torch.nn.functional.cross_entropy(x.reshape(rows, c),
                                                           p["labels"].long())))
        return
    target = rng.normal(size=shape)
    if kind == "bce":
        target = rng.uniform(size=shape)
    r.consts["target"] = target
    mf = {"weighted_sum": lambda x, t: (x * t).sum(), "mse": mn.ops.mse_loss,
          "bce": mn.ops.bce_with_logits}[kind]
    tf = {"weighted_sum": lambda x, t: (x * t).sum(), "mse": torch.nn.functional.mse_loss,
          "bce": torch.nn.functional.binary_cross_entropy_with_logits}[kind]
    r.steps.append(Step(kind, lambda x, p: mf(x, p["target"]), lambda x, p: tf(x, p["target"])))


# ----------------------------------------------------------------------------- evaluation


def _values(r: Recipe) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(r.seed)
    return {n: rng.normal(size=s).astype(np.float32) for n, s in r.params.items()}


def _build(r: Recipe):
    """(graph with gradients, {"y": last value before the loss, "loss", "grad.<p>"...})."""
    g = mn.Graph("random")
    env = {n: g.param(n, s) for n, s in r.params.items()}
    env["target"] = g.const(r.consts["target"].astype(np.float32)) if "target" in r.consts \
        else None
    if "labels" in r.consts:
        env["labels"] = g.const(r.consts["labels"], dtype=mn.i32)
    x = env["p0"]
    for s in r.steps[:-1]:
        x = s.mn(x, env)
    loss = r.steps[-1].mn(x, env)
    g2, grads = mn.grad(g, loss)
    outs = {"y": g2[x], "loss": g2[loss]}
    outs.update({f"grad.{n}": v for n, v in grads.items()})
    return g2, outs


def _torch(r: Recipe, values):
    ps = {n: torch.tensor(v, dtype=torch.float64, requires_grad=True) for n, v in values.items()}
    env = dict(ps)
    for k, v in r.consts.items():
        env[k] = torch.tensor(v if k == "labels" else v.astype(np.float32).astype(np.float64))
    x = env["p0"]
    for s in r.steps[:-1]:
        x = s.torch(x, env)
    loss = r.steps[-1].torch(x, env)
    loss.backward()
    out = {"y": x.detach().numpy(), "loss": loss.detach().numpy()}
    out.update({f"grad.{n}": p.grad.numpy() if p.grad is not None else np.zeros(p.shape)
                for n, p in ps.items()})
    return out


def _run(r: Recipe, values, **compile_args):
    g2, outs = _build(r)
    sess = mn.compile(g2, outputs=outs, **compile_args)
    sess.set_params(values)
    return sess.run()


def _err(a, b, atol: float) -> float:
    """RMS difference over (atol + RMS of b): relative error, with an absolute floor for
    values that cancel (x - mean(x) of nearly equal numbers has few significant bits left)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, f"shape {a.shape} vs {b.shape}"
    n = max(a.size, 1)
    return float(np.linalg.norm(a - b) / np.sqrt(n) / (atol + np.linalg.norm(b) / np.sqrt(n)))


def _compare(ours, theirs, tol, what, atol=1e-12):
    for k, v in theirs.items():
        if k not in ours:  # a parameter the loss does not reach has no gradient value
            assert not np.any(v), f"{what}: {k} missing but nonzero"
            continue
        e = _err(ours[k], v, atol)
        assert e <= tol, f"{what}: {k} relative error {e:.2e} > {tol:.0e}"


# ----------------------------------------------------------------------------- tests


@_settings(300)
@given(recipes())
def test_reference_float64_matches_torch_autograd(r):
    """The reference interpreter's forward values and mn.grad gradients vs PyTorch float64."""
    note(str(r))
    values = _values(r)
    ours = _run(r, values, backend="reference", dtype=np.float64)
    _compare(ours, _torch(r, values), 1e-9, "reference f64 vs torch f64")


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@_settings(25)
@given(recipes(max_steps=4))
def test_gpu_matches_reference_float64(r):
    """The whole GPU path (fusion, planning, WGSL on lavapipe) vs the float64 oracle."""
    note(str(r))
    values = _values(r)
    ours = _run(r, values)
    _compare(ours, _run(r, values, backend="reference", dtype=np.float64), 2e-4,
             "wgpu f32 vs reference f64", atol=5e-3)


# ----------------------------------------------------------------------------- found by it


@pytest.mark.gpu
@pytest.mark.parametrize("a_shape, b_shape, transpose_b", [((1,), (1, 1), True),
                                                          ((3,), (3, 1), False)])
def test_fetched_reshape_of_a_matmul_with_a_fused_epilogue(gpu, a_shape, b_shape, transpose_b):
    """A vector-matrix product with one output column: its result is fetched through a
    reshape, and sum(y * 0.5) over one element becomes a reshape, so the mul also wanted to be
    the matmul's epilogue.  The matmul output was then never stored and planning the fetch
    failed with a KeyError; a fetched view now keeps its base materialized."""
    g = mn.Graph("vecmat")
    a, b = g.param("a", a_shape), g.param("b", b_shape)
    y = mn.ops.matmul(a, b, transpose_b=transpose_b)
    outs = {"y": y, "loss": (y * 0.5).sum()}
    vals = {"a": np.full(a_shape, 2.0, np.float32), "b": np.full(b_shape, 3.0, np.float32)}
    got = []
    for backend in ("wgpu", "reference"):
        s = mn.compile(g, outputs=outs, backend=backend)
        s.set_params(vals)
        got.append(s.run())
    for k in outs:
        np.testing.assert_allclose(got[0][k], got[1][k], rtol=1e-6)
