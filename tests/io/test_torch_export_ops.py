"""Single ATen converters against PyTorch (issue 17), the ops no whole model of
``test_torch_export.py`` reaches: tiny modules of a few ops each, imported with
``mn.from_torch``, forward ≤ 1e-5 and gradients ≤ 1e-4 relative L2 against PyTorch float32,
on edge values (negative operands of remainder and floor division, zeros, exact quotients,
ties of max/min/clamp), on the reference backend and a GPU subset (lavapipe in CI).

Our autodiff differentiates parameters, so each float input enters as ``x + d`` with ``d`` a
zero parameter: ``x + 0`` is ``x`` exactly, and ``d``'s gradient is the input's gradient."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from .torch_check import gates

A = torch.ops.aten

# dividends and divisors of every sign, exact quotients (-6/2, 6/-3), a zero dividend
_NUM = torch.tensor([-7.0, -6.0, -5.5, -1.0, 0.0, 1.0, 5.5, 6.0, 7.0, 3.0, -0.25, 2.0])
_DEN = torch.tensor([2.0, 2.0, -2.0, 3.0, 3.0, -3.0, -2.0, -3.0, 4.0, 3.0, 0.5, -0.75])
# activations' inputs: both signs, zero, ties (x == y at 1.0 and 0.0)
_X = torch.tensor([[-3.0, -1.0, -0.5, 0.0, 0.25, 1.0], [2.0, -2.0, 0.75, -0.125, 3.0, 1.5]])
_Y = torch.tensor([[1.0, -1.0, 0.5, 0.0, -0.25, 1.0], [-2.0, -2.5, 0.5, 0.25, 3.0, -1.5]])
_POS = torch.tensor([[0.25, 0.5, 1.0, 1.5, 2.0, 4.0], [0.3, 0.7, 1.2, 2.5, 3.5, 0.1]])


def _div_modes(a, b):
    return (torch.div(a, b, rounding_mode="floor"), torch.div(a, b, rounding_mode="trunc"),
            torch.div(a, 2.5, rounding_mode="floor"), torch.div(a, -2.5, rounding_mode="trunc"))


def _remainder(a, b):
    return torch.remainder(a, b), torch.remainder(a, 2.5), torch.remainder(a, -1.5), a % b


def _pow(x, p):
    return (x ** 2, x ** 3, p ** -1, x ** 0, p ** 0.5, p ** 1.5, p ** -2.5, torch.pow(2.0, x),
            torch.pow(0.5, x), p ** x, A.pow.Scalar(3.0, x))


def _activations(x):
    return (F.elu(x), F.elu(x, alpha=0.5), F.celu(x, alpha=2.0), F.selu(x),
            F.leaky_relu(x), F.leaky_relu(x, 0.2), F.relu6(x * 3), F.hardtanh(x, -0.5, 1.0),
            F.silu(x), F.mish(x), F.softplus(x), F.logsigmoid(x),
            # off their kinks (±3): there the export's decomposition (clamps, whose gradient
            # passes at the bounds) and eager PyTorch's own backward differ
            F.hardswish(x * 3.5), F.hardsigmoid(x * 3.5))


def _unary(x, p):
    return (torch.abs(x), torch.sign(x), torch.ceil(x * 1.5), torch.floor(x * 1.5),
            torch.trunc(x * 1.5), torch.sin(x), torch.cos(x),
            torch.erf(x), torch.exp(x), torch.exp2(x), torch.expm1(x), torch.log(p),
            torch.log1p(p), torch.log2(p), torch.log10(p), torch.sqrt(p), torch.rsqrt(p),
            torch.reciprocal(p), torch.square(x), torch.neg(x), torch.sigmoid(x), torch.tanh(x))


def _arith(x, y):
    return (A.add.Scalar(x, 2.0), A.sub.Scalar(x, 0.5), A.rsub.Scalar(x, 3.0),
            A.rsub.Tensor(x, y, alpha=2), A.div.Scalar(x, 4.0), torch.add(x, y, alpha=-0.5),
            torch.sub(x, y, alpha=3), x / (y.abs() + 1), 2.0 - x, 1.0 / (x.abs() + 1))


def _compare(x, y):
    """Comparisons and logic as masks of ``where`` (ties at x == y) and as outputs."""
    m = (x < y) | ((x >= 0.5) & ~(x == y))
    return (torch.where(x > y, x, y), torch.where(x <= y, x, 2.0), torch.where(x != y, 1.5, y),
            torch.where(m, 1.0, -1.0), torch.maximum(x, y), torch.minimum(x, y),
            torch.clamp(x, -1.0, 1.0), torch.clamp(x, min=0.0), torch.clamp(x, max=0.5),
            torch.clamp(x, y, y + 1), x >= y, x.eq(y), torch.logical_and(x > 0, y > 0),
            torch.logical_or(x > 0, y > 0), torch.logical_not(x > 0), torch.isclose(x, y))


def _reduce(x):
    return (x.amax(1), x.amin(0, keepdim=True), x.max(1).values, x.min(0).values,
            torch.logsumexp(x, 1), x.var(1), x.var(0, correction=0), x.std(),
            torch.any(x > 2.5, 1), torch.any(x > 2.5), F.log_softmax(x, 0), F.softmax(x, 1),
            x.sum(), x.mean(1), torch.cumsum(torch.ones(3), 0) * x[0, :3])


def _shape(x, idx):
    t = x.reshape(3, 4)
    parts = torch.split(t, 3, dim=1)
    rows = torch.unbind(t, 0)
    return (t.flip(0, 1), t.t(), t.transpose(0, 1).unsqueeze(0).squeeze(0), parts[0], parts[1],
            rows[2], t.index_select(1, idx % 4), t[:, idx], t[idx.clamp(max=2)],
            t.gather(1, (idx % 4).view(1, -1).expand(3, -1)), t.narrow(1, 1, 2), t[-1], t[:, -2:],
            t.expand(2, 3, 4), torch.stack([t, -t]), torch.zeros_like(t), torch.ones_like(t) * t,
            torch.full_like(t, 2.0) - t)


def _pad(x):
    """Negative pads crop; mixed signs crop one side and pad the other."""
    x4 = x.reshape(1, 2, 2, 3)
    return (F.pad(x4, (-1, 0)), F.pad(x4, (1, -1, -1, 0)), F.pad(x4, (0, -2, 1, 1), value=0.5),
            F.pad(x4, (2, 1), value=-1.0), F.pad(x4, (1, 1, 1, 1), mode="replicate"),
            F.pad(x4, (1, 1, 1, 0), mode="reflect"), F.pad(x4, (-1, -1, 0, 0, 1, 0)))


def _nn(x, y):
    img = x.reshape(1, 2, 2, 3)
    q = x.reshape(2, 3, 2)
    mask = torch.tensor([[True, False, True], [True, True, False], [False, True, True]])
    return (F.max_pool2d(img, (2, 1), (1, 1)),
            F.adaptive_avg_pool2d(torch.cat([img, img * 2], 2), (2, 3)),
            F.avg_pool2d(img, (1, 3), padding=(0, 1), count_include_pad=False),
            torch.baddbmm(y.reshape(2, 3, 2)[:, :, :1], q, q.transpose(1, 2)[:, :, :1],
                          beta=0.5, alpha=2.0),
            torch.addmm(y[0, :2], x.reshape(3, 4), y.reshape(4, 3)[:, :2], beta=0.0),
            F.scaled_dot_product_attention(q, q * 0.5, q + 1, attn_mask=mask),
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.tril(mask) * 0.5),
            F.interpolate(img, size=(3, 4), mode="nearest"),
            F.interpolate(img, scale_factor=2, mode="bilinear", align_corners=True),
            F.dropout(x, 0.3, training=False), F.layer_norm(x, (6,)), F.group_norm(img, 1))


def _two(a, b):
    return a, b


_CASES = {
    "div_rounding": (_div_modes, (_NUM, _DEN)),
    "remainder": (_remainder, (_NUM, _DEN)),
    "pow": (_pow, (_X, _POS)),
    "activations": (_activations, (_X,)),
    "unary": (_unary, (_X, _POS)),
    "arith": (_arith, (_X, _Y)),
    "compare": (_compare, (_X, _Y)),
    "reduce": (_reduce, (_X,)),
    "shape": (_shape, (_X, torch.tensor([3, 0, -1]))),
    "pad": (_pad, (_X,)),
    "nn": (_nn, (_X, _Y)),
}


class _Ops(nn.Module):
    """``fn`` of the inputs, each float input plus a zero parameter (see the module doc)."""

    def __init__(self, fn, inputs):
        super().__init__()
        self.fn = fn
        self.d = nn.ParameterList([nn.Parameter(torch.zeros_like(x)) for x in inputs
                                   if x.is_floating_point()])

    def forward(self, *xs):
        ds = iter(self.d)
        return self.fn(*(x + next(ds) if x.is_floating_point() else x for x in xs))


def _weighted_sum(outs, *weights):
    return sum((o.float() * w).sum() for o, w in zip(outs, weights))


def _check(name, **kw):
    fn, inputs = _CASES[name]
    module = _Ops(fn, inputs)
    torch.manual_seed(0)
    weights = tuple(torch.randn(o.shape) for o in module(*inputs))
    return gates(module, inputs, _weighted_sum, weights, **kw)


@pytest.mark.parametrize("name", sorted(_CASES))
def test_reference_backend_matches_pytorch(name):
    _check(name, backend="reference")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["div_rounding", "remainder", "pow", "activations", "pad"])
def test_gpu_matches_pytorch(gpu, name):
    _check(name, backend="wgpu", device=gpu)
