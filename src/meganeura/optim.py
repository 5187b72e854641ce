"""Optimizers and learning-rate schedules as graph-level update rules.

An optimizer appends the parameter update to a graph that already holds the gradients (from
:func:`meganeura.autodiff.grad`)::

    g2, grads = mn.grad(g, loss)
    updates = mn.optim.AdamW(lr=1e-3).apply(g2, grads)   # registers graph.set_update(...)

Semantics are PyTorch's, formula for formula and in the same operation order
(``torch.optim.SGD``/``Adam``/``AdamW`` single-tensor path, ``torch.nn.utils.clip_grad_norm_``,
``LambdaLR``/``StepLR`` stepped once after every optimizer step), so a float64 run of the
reference interpreter follows PyTorch to rounding error.

Layout (what the GPU runtime's chunked optimizer kernels rely on): parameters are partitioned
into *groups* by (lr multiplier, weight decay applies, dtype).  Within group ``k`` the update is
computed on one flat vector ``concat([p.reshape(-1) for p in group])``; the optimizer states are
flat per group and named ``optim.<slot>.g<k>`` (``optim.exp_avg.g0``, ``optim.exp_avg_sq.g0``,
``optim.momentum_buffer.g0``); the new flat parameters are split back and reshaped.  One f32
scalar state ``optim.step`` counts the updates done (0 before the first; update ``t`` (1-based)
uses bias corrections with ``t`` and the learning rate ``schedule.value(t - 1)``).  Non-f32 float
parameters (f16) are updated in f32 (their states are f32) and cast back.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import numpy as np

from .dtypes import f32
from .errors import GraphBuildError
from .graph import Graph, Value
from .init import zeros

__all__ = [
    "OptimizerError", "Schedule", "Constant", "WarmupCosine", "StepLR",
    "Optimizer", "SGD", "Adam", "AdamW", "STEP_STATE",
]

STEP_STATE = "optim.step"


class OptimizerError(GraphBuildError):
    """Bad optimizer or schedule hyperparameters, or an update that cannot be built."""


def _ops():
    from . import ops

    return ops


def _num(x, what: str, *, low: float | None = 0.0, high: float | None = None,
         low_open: bool = False, high_open: bool = False) -> float:
    """A finite real number within [low, high] (open ends where asked), else OptimizerError."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise OptimizerError(f"{what} must be a real number, got {x!r}")
    x = float(x)
    if not math.isfinite(x):
        raise OptimizerError(f"{what} must be finite, got {x}")
    if low is not None and (x <= low if low_open else x < low):
        rel = ">" if low_open else ">="
        raise OptimizerError(f"{what} must be {rel} {low}, got {x}")
    if high is not None and (x >= high if high_open else x > high):
        rel = "<" if high_open else "<="
        raise OptimizerError(f"{what} must be {rel} {high}, got {x}")
    return x


def _int(x, what: str, low: int = 0) -> int:
    if isinstance(x, (float, np.floating)) and float(x).is_integer():
        x = int(x)
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise OptimizerError(f"{what} must be an int, got {x!r}")
    if x < low:
        raise OptimizerError(f"{what} must be >= {low}, got {x}")
    return int(x)


# ---------------------------------------------------------------------------------------------
# schedules


class Schedule(ABC):
    """Learning rate as a function of the number of updates already done (``step``, from 0).

    ``value(step)`` is the Python float; ``build(step)`` the same expression as graph ops of the
    f32 scalar ``step`` value.  The update number ``t`` (1-based) uses ``value(t - 1)``: the
    lr PyTorch uses when ``scheduler.step()`` is called after every ``optimizer.step()``.
    """

    lr: float

    @abstractmethod
    def value(self, step: int) -> float: ...

    @abstractmethod
    def build(self, step: Value) -> Value: ...

    def _check_step(self, step) -> int:
        return _int(step, f"{type(self).__name__}.value(step)")


class Constant(Schedule):
    """A fixed learning rate."""

    def __init__(self, lr: float):
        self.lr = _num(lr, "Constant: lr")

    def value(self, step: int) -> float:
        self._check_step(step)
        return self.lr

    def build(self, step: Value) -> Value:
        return step.graph.scalar(self.lr, step.dtype)

    def __repr__(self) -> str:
        return f"Constant(lr={self.lr!r})"


class WarmupCosine(Schedule):
    """Linear warm-up from 0 to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at
    ``total_steps`` (and ``min_lr`` after it)::

        step < warmup:   lr * step / warmup
        else:            min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * p)),
                         p = clamp((step - warmup) / (total - warmup), 0, 1)
    """

    def __init__(self, lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0):
        self.lr = _num(lr, "WarmupCosine: lr")
        self.warmup_steps = _int(warmup_steps, "WarmupCosine: warmup_steps")
        self.total_steps = _int(total_steps, "WarmupCosine: total_steps", low=1)
        if self.total_steps < self.warmup_steps:
            raise OptimizerError(f"WarmupCosine: total_steps ({self.total_steps}) must be >= "
                                 f"warmup_steps ({self.warmup_steps})")
        self.min_lr = _num(min_lr, "WarmupCosine: min_lr", high=self.lr)

    def value(self, step: int) -> float:
        s = self._check_step(step)
        w, n = self.warmup_steps, self.total_steps
        if s < w:
            return self.lr * s / w
        if n == w:
            return self.min_lr
        p = min(max((s - w) / (n - w), 0.0), 1.0)
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))

    def build(self, step: Value) -> Value:
        ops = _ops()
        w, n = self.warmup_steps, self.total_steps
        if n == w:
            decay = step.graph.scalar(self.min_lr, step.dtype)
        else:
            p = ops.minimum(ops.maximum((step - float(w)) / float(n - w), 0.0), 1.0)
            decay = self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + ops.cos(math.pi * p))
        if w == 0:
            return decay
        warm = self.lr * step / float(w)
        return ops.where(step < float(w), warm, decay)

    def __repr__(self) -> str:
        return (f"WarmupCosine(lr={self.lr!r}, warmup_steps={self.warmup_steps}, "
                f"total_steps={self.total_steps}, min_lr={self.min_lr!r})")


class StepLR(Schedule):
    """``lr * gamma ** (step // step_size)`` (PyTorch's ``StepLR``)."""

    def __init__(self, lr: float, step_size: int, gamma: float = 0.1):
        self.lr = _num(lr, "StepLR: lr")
        self.step_size = _int(step_size, "StepLR: step_size", low=1)
        self.gamma = _num(gamma, "StepLR: gamma")

    def value(self, step: int) -> float:
        s = self._check_step(step)
        return self.lr * self.gamma ** (s // self.step_size)

    def build(self, step: Value) -> Value:
        ops = _ops()
        k = ops.floor(step / float(self.step_size))
        return self.lr * ops.pow(self.gamma, k)

    def __repr__(self) -> str:
        return f"StepLR(lr={self.lr!r}, step_size={self.step_size}, gamma={self.gamma!r})"


def _as_schedule(lr, who: str) -> Schedule:
    if isinstance(lr, Schedule):
        return lr
    if isinstance(lr, type) and issubclass(lr, Schedule):
        raise OptimizerError(f"{who}: lr must be a number or a schedule instance, got the class "
                             f"{lr.__name__}")
    return Constant(_num(lr, f"{who}: lr"))


# ---------------------------------------------------------------------------------------------
# optimizers


def _prefixes(x, what: str) -> tuple[str, ...]:
    if x is None:
        return ()
    if isinstance(x, str):
        raise OptimizerError(f"{what} must be a tuple of name prefixes, got the string {x!r}; "
                             f"write ({x!r},)")
    try:
        out = tuple(x)
    except TypeError:
        raise OptimizerError(f"{what} must be a tuple of name prefixes, got {x!r}") from None
    for p in out:
        if not isinstance(p, str):
            raise OptimizerError(f"{what}: prefixes must be strings, got {p!r} "
                                 f"({type(p).__name__})")
    return out


def _multipliers(x) -> dict[str, float]:
    if x is None:
        return {}
    if not isinstance(x, Mapping):
        raise OptimizerError(f"lr_multipliers must be a dict of name prefix -> float, got {x!r}")
    out = {}
    for k, v in x.items():
        if not isinstance(k, str):
            raise OptimizerError(f"lr_multipliers: keys must be parameter-name prefixes (str), "
                                 f"got {k!r} ({type(k).__name__})")
        out[k] = _num(v, f"lr_multipliers[{k!r}]")
    return out


class Optimizer(ABC):
    """Common machinery: schedule, global gradient clipping, per-prefix lr multipliers and
    weight-decay exclusions, grouping into flat vectors, and the step counter."""

    #: names of the flat per-group state slots this optimizer keeps (set per instance)
    slots: tuple[str, ...] = ()

    def __init__(self, lr, weight_decay: float = 0.0, clip_grad_norm: float | None = None,
                 lr_multipliers: Mapping[str, float] | None = None,
                 no_weight_decay: Sequence[str] = ()):
        who = type(self).__name__
        self.schedule = _as_schedule(lr, who)
        self.weight_decay = _num(weight_decay, f"{who}: weight_decay")
        self.clip_grad_norm = (None if clip_grad_norm is None else
                               _num(clip_grad_norm, f"{who}: clip_grad_norm", low_open=True))
        self.lr_multipliers = _multipliers(lr_multipliers)
        self.no_weight_decay = _prefixes(no_weight_decay, f"{who}: no_weight_decay")
        self.groups: list[tuple[tuple[str, ...], float, bool]] = []
        self._state_names: list[str] = []

    # -- per-parameter options ------------------------------------------------------------------
    def lr_multiplier(self, name: str) -> float:
        """The multiplier of the longest prefix of ``name`` in ``lr_multipliers`` (default 1)."""
        best, mult = -1, 1.0
        for p, m in self.lr_multipliers.items():
            if name.startswith(p) and len(p) > best:
                best, mult = len(p), m
        return mult

    def decays(self, name: str) -> bool:
        """Whether weight decay applies to parameter ``name``."""
        return self.weight_decay != 0 and not any(name.startswith(p) for p in self.no_weight_decay)

    def lr_at(self, step: int) -> float:
        """Base learning rate of update ``step + 1`` (before multipliers)."""
        return self.schedule.value(step)

    def state_names(self) -> list[str]:
        """Names of the states ``apply`` created (``optim.step`` first)."""
        return list(self._state_names)

    # -- building -------------------------------------------------------------------------------
    def apply(self, graph: Graph, grads: Mapping[str, Value],
              guard: Value | None = None) -> dict[str, Value]:
        """Append the update of every parameter in ``grads`` (name -> gradient value of ``graph``)
        and of the optimizer states; registers each with ``graph.set_update`` and returns them.

        ``guard``: a bool scalar of ``graph`` (``compile(nan_check="step")``); where it is false
        every update keeps the old value (parameters, states and the step counter), selected
        on the flat group vectors so the in-place group layout is unchanged."""
        self._check_apply(graph, grads)
        if guard is not None and (not isinstance(guard, Value) or guard.graph is not graph
                                  or guard.shape != () or guard.dtype.name != "bool"):
            raise OptimizerError(f"{type(self).__name__}.apply: guard must be a bool scalar "
                                 f"value of this graph, got {guard!r}")
        return self._build_updates(graph, grads, guard)

    def _check_apply(self, graph: Graph, grads: Mapping[str, Value]) -> None:
        """Every misuse of ``apply`` as one OptimizerError naming the culprit, before any
        node is added."""
        who = type(self).__name__
        if not isinstance(graph, Graph):
            raise OptimizerError(f"{who}.apply: expected a Graph, got {type(graph).__name__}")
        if not isinstance(grads, Mapping) or not grads:
            raise OptimizerError(f"{who}.apply: grads must be a non-empty dict of parameter name "
                                 f"-> gradient value (from mn.grad), got {grads!r}")
        if STEP_STATE in graph.leaves:
            raise OptimizerError(f"{who}.apply: the graph already has optimizer state "
                                 f"{STEP_STATE!r}; apply one optimizer once per graph")
        params = graph.params
        for name, gv in grads.items():
            if name not in params:
                kind = graph.leaves[name].kind if name in graph.leaves else "unknown name"
                raise OptimizerError(f"{who}.apply: {name!r} is not a parameter of the graph "
                                     f"({kind})")
            if not isinstance(gv, Value) or gv.graph is not graph:
                raise OptimizerError(f"{who}.apply: the gradient of {name!r} must be a value of "
                                     f"this graph (use the graph returned by mn.grad)")
            if gv.type != params[name].type:
                raise OptimizerError(f"{who}.apply: gradient of {name!r} is {gv.type}, the "
                                     f"parameter is {params[name].type}")
            if not gv.dtype.is_float:
                raise OptimizerError(f"{who}.apply: parameter {name!r} is {gv.dtype.name}; only "
                                     f"floating-point parameters can be trained")
        for what, prefixes in (("lr_multipliers", tuple(self.lr_multipliers)),
                               ("no_weight_decay", self.no_weight_decay)):
            for p in prefixes:
                if not any(n.startswith(p) for n in params):
                    raise OptimizerError(f"{who}: {what} prefix {p!r} matches no parameter of the "
                                         f"graph (parameters: {_preview(params)})")

    def _build_updates(self, graph: Graph, grads: Mapping[str, Value],
                       guard: Value | None = None) -> dict[str, Value]:
        params = graph.params
        ops = _ops()

        def keep(new: Value, old: Value) -> Value:
            return new if guard is None else ops.where(guard, new, old)

        names = list(grads)
        # groups by (lr multiplier, decays, dtype), ordered by first appearance
        keyed: dict[tuple, list[str]] = {}
        for n in names:
            key = (self.lr_multiplier(n), self.decays(n), params[n].dtype)
            keyed.setdefault(key, []).append(n)
        self.groups = [(tuple(ns), k[0], k[1]) for k, ns in keyed.items()]
        self._state_names = [STEP_STATE]

        step = graph.state(STEP_STATE, (), f32, init=zeros())
        t = step + 1.0
        lr = self.schedule.build(step)

        flat_p, flat_g = [], []
        for ns, _, _ in self.groups:
            flat_p.append(_flat([params[n] for n in ns]).cast(f32))
            flat_g.append(_flat([grads[n] for n in ns]).cast(f32))

        if self.clip_grad_norm is not None:
            flat_g = self._clipped(flat_g)

        updates: dict[str, Value] = {}
        per_group = zip(self.groups, flat_p, flat_g, strict=True)
        for k, ((ns, mult, decays), p, gr) in enumerate(per_group):
            states = {}
            for slot in self.slots:
                sname = f"optim.{slot}.g{k}"
                states[slot] = graph.state(sname, p.shape, f32, init=zeros())
                self._state_names.append(sname)
            lr_k = lr * mult if mult != 1.0 else lr
            new_p, new_states = self._update(p, gr, states, lr_k, t, decays)
            new_p = keep(new_p, p)
            for slot, v in new_states.items():
                updates[f"optim.{slot}.g{k}"] = keep(v, states[slot])
            sizes = [params[n].size for n in ns]
            parts = ops.split(new_p, sizes, 0) if len(ns) > 1 else (new_p,)
            for n, part in zip(ns, parts, strict=True):
                updates[n] = ops.reshape(part, params[n].shape).cast(params[n].dtype)
        updates[STEP_STATE] = keep(t, step)
        # parameters first (in grads order), then states
        ordered = {n: updates[n] for n in names}
        ordered.update({s: updates[s] for s in self._state_names})
        for n, v in ordered.items():
            graph.set_update(n, v)
        return ordered

    def _clipped(self, flat_g: list[Value]) -> list[Value]:
        """The flat gradients scaled to a global L2 norm of at most ``clip_grad_norm``
        (``torch.nn.utils.clip_grad_norm_``)."""
        ops = _ops()
        sq = [ops.sum(ops.square(fg)) for fg in flat_g]
        total = sq[0]
        for s in sq[1:]:
            total = total + s
        total_norm = ops.sqrt(total)
        coef = ops.minimum(self.clip_grad_norm / (total_norm + 1e-6), 1.0)
        return [fg * coef for fg in flat_g]

    @abstractmethod
    def _update(self, p: Value, g: Value, states: dict[str, Value], lr: Value, t: Value,
                decays: bool) -> tuple[Value, dict[str, Value]]:
        """New flat parameter and new states of one group (all f32 vectors)."""


def _flat(values: list[Value]) -> Value:
    ops = _ops()
    return ops.concat([ops.reshape(v, (-1,)) for v in values], 0)


def _preview(params: Mapping[str, Value], n: int = 6) -> str:
    names = list(params)
    more = f", … ({len(names)} in all)" if len(names) > n else ""
    return ", ".join(repr(x) for x in names[:n]) + more


class SGD(Optimizer):
    """``torch.optim.SGD``: weight decay (L2, added to the gradient), momentum with dampening
    (the first update sets the buffer to the gradient), Nesterov."""

    def __init__(self, lr, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, *, clip_grad_norm: float | None = None,
                 lr_multipliers: Mapping[str, float] | None = None,
                 no_weight_decay: Sequence[str] = ()):
        super().__init__(lr, weight_decay, clip_grad_norm, lr_multipliers, no_weight_decay)
        self.momentum = _num(momentum, "SGD: momentum")
        self.dampening = _num(dampening, "SGD: dampening", low=None)
        self.nesterov = bool(nesterov)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise OptimizerError("SGD: nesterov=True requires momentum > 0 and dampening == 0 "
                                 f"(got momentum={self.momentum}, dampening={self.dampening})")
        self.slots = ("momentum_buffer",) if self.momentum != 0 else ()

    def _update(self, p, g, states, lr, t, decays):
        ops = _ops()
        if decays:
            g = g + self.weight_decay * p
        new_states = {}
        if self.momentum != 0:
            buf = states["momentum_buffer"]
            running = buf * self.momentum + (1.0 - self.dampening) * g
            # PyTorch's first update copies the gradient into the buffer (no dampening); with
            # dampening 0 the running formula already gives exactly g from the zero buffer.
            new_buf = ops.where(t.eq(1.0), g, running) if self.dampening != 0 else running
            new_states["momentum_buffer"] = new_buf
            g = g + self.momentum * new_buf if self.nesterov else new_buf
        return p - lr * g, new_states

    def __repr__(self) -> str:
        return (f"SGD(lr={self.schedule!r}, momentum={self.momentum}, dampening={self.dampening}, "
                f"nesterov={self.nesterov}, weight_decay={self.weight_decay})")


class Adam(Optimizer):
    """``torch.optim.Adam`` (weight decay is L2: added to the gradient)."""

    decoupled = False

    def __init__(self, lr=1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, clip_grad_norm: float | None = None,
                 lr_multipliers: Mapping[str, float] | None = None,
                 no_weight_decay: Sequence[str] = ()):
        super().__init__(lr, weight_decay, clip_grad_norm, lr_multipliers, no_weight_decay)
        who = type(self).__name__
        try:
            b1, b2 = betas
        except (TypeError, ValueError):
            raise OptimizerError(f"{who}: betas must be a pair (beta1, beta2), got {betas!r}") \
                from None
        self.beta1 = _num(b1, f"{who}: betas[0]", high=1.0, high_open=True)
        self.beta2 = _num(b2, f"{who}: betas[1]", high=1.0, high_open=True)
        self.eps = _num(eps, f"{who}: eps")
        self.slots = ("exp_avg", "exp_avg_sq")

    @property
    def betas(self) -> tuple[float, float]:
        return (self.beta1, self.beta2)

    def _update(self, p, g, states, lr, t, decays):
        ops = _ops()
        b1, b2 = self.beta1, self.beta2
        if decays:
            if self.decoupled:
                p = p * (1.0 - lr * self.weight_decay)
            else:
                g = g + self.weight_decay * p
        m, v = states["exp_avg"], states["exp_avg_sq"]
        w = 1.0 - b1  # exp_avg.lerp_(grad, 1 - beta1), torch's two-sided lerp formula
        new_m = m + w * (g - m) if abs(w) < 0.5 else g - (g - m) * (1.0 - w)
        new_v = v * b2 + (1.0 - b2) * g * g
        bias_correction1 = _bias_correction(ops, b1, t)
        bias_correction2 = _bias_correction(ops, b2, t)
        step_size = lr / bias_correction1
        bias_correction2_sqrt = ops.pow(bias_correction2, 0.5)
        denom = ops.sqrt(new_v) / bias_correction2_sqrt + self.eps
        new_p = p - step_size * new_m / denom
        return new_p, {"exp_avg": new_m, "exp_avg_sq": new_v}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(lr={self.schedule!r}, betas={self.betas}, eps={self.eps}, "
                f"weight_decay={self.weight_decay})")


class AdamW(Adam):
    """``torch.optim.AdamW``: decoupled weight decay ``p *= 1 - lr * weight_decay`` before the
    Adam step (``lr`` includes the schedule and the parameter's multiplier)."""

    decoupled = True

    def __init__(self, lr=1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, *, clip_grad_norm: float | None = None,
                 lr_multipliers: Mapping[str, float] | None = None,
                 no_weight_decay: Sequence[str] = ()):
        super().__init__(lr, betas, eps, weight_decay, clip_grad_norm=clip_grad_norm,
                         lr_multipliers=lr_multipliers, no_weight_decay=no_weight_decay)


def _bias_correction(ops, beta: float, t):
    """1 - beta**t as -expm1(t·ln beta) with ln beta taken in float64: exact to a few f32 ulp,
    where 1 - pow(beta, t) in f32 loses ~1e-5 relatively (beta rounded to f32, cancellation)."""
    if beta == 0.0:
        return 1.0
    return -ops.expm1(t * math.log(beta))
