"""Optimizers and schedules against torch.optim, step by step, in float64.

Our side: ``mn.grad`` then ``opt.apply``; each step evaluates every update with the reference
interpreter in float64 and writes params and states back.  Torch side: the same model, loss and
batches, ``torch.optim`` with param groups for multipliers/no-decay, ``clip_grad_norm_`` and
``LambdaLR``/``StepLR`` stepped after every ``optimizer.step()``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import meganeura as mn
from meganeura import optim
from meganeura.init import init_leaves
from meganeura.reference import evaluate

TOL = 1e-10
STEPS = 20
BATCH, D_IN, D_HID, N_CLS = 8, 4, 6, 3
PARAM_SHAPES = {
    "fc1.weight": (D_IN, D_HID),
    "fc1.bias": (D_HID,),
    "fc2.weight": (D_HID, N_CLS),
    "fc2.bias": (N_CLS,),
    "scale": (),
}


def build_graph():
    """A tanh MLP with a scalar logit scale and softmax cross-entropy."""
    g = mn.Graph("mlp")
    x = g.input("x", (BATCH, D_IN))
    y = g.input("y", (BATCH,), dtype=mn.i32)
    p = {n: g.param(n, s, init=mn.init.normal(0.5)) for n, s in PARAM_SHAPES.items()}
    h = (x @ p["fc1.weight"] + p["fc1.bias"]).tanh()
    logits = (h @ p["fc2.weight"] + p["fc2.bias"]) * (p["scale"] + 1.0)
    return g, mn.ops.cross_entropy(logits, y)


def torch_loss(tp, x, y):
    h = torch.tanh(x @ tp["fc1.weight"] + tp["fc1.bias"])
    logits = (h @ tp["fc2.weight"] + tp["fc2.bias"]) * (tp["scale"] + 1.0)
    return torch.nn.functional.cross_entropy(logits, y)


def batches(seed):
    rng = np.random.default_rng(seed)
    for _ in range(STEPS):
        yield (rng.normal(size=(BATCH, D_IN)),
               rng.integers(0, N_CLS, size=(BATCH,)).astype(np.int32))


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    scale = max(float(np.max(np.abs(ref))), 1e-300)
    return float(np.max(np.abs(ours - ref))) / scale


TORCH_STATE_SLOTS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq",
                     "momentum_buffer": "momentum_buffer"}


def run_against_torch(opt, make_torch, seed=0, clip=None, expect_clipped=None):
    """Train both sides for STEPS steps; check every param (and flat state) after every step.

    ``make_torch(params: dict[name, tensor]) -> (torch optimizer, scheduler or None)``.
    Returns the worst relative error seen and the torch total grad norms (when clipping).
    """
    g, loss = build_graph()
    g2, grads = mn.grad(g, loss)
    updates = opt.apply(g2, grads)
    env = {k: v.astype(np.float64) for k, v in init_leaves(g2, seed).items()}
    tp = {n: torch.tensor(env[n], dtype=torch.float64, requires_grad=True) for n in PARAM_SHAPES}
    topt, sched = make_torch(tp)
    worst, norms = 0.0, []
    for step, (xb, yb) in enumerate(batches(seed + 1), start=1):
        env["x"], env["y"] = xb, yb
        vals = evaluate(g2, list(updates.values()), env, dtype=np.float64)
        env.update(zip(updates, vals, strict=True))

        topt.zero_grad()
        torch_loss(tp, torch.tensor(xb), torch.tensor(yb, dtype=torch.long)).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(tp.values()), clip,
                                                              foreach=False)))
        topt.step()
        if sched is not None:
            sched.step()

        assert float(env[optim.STEP_STATE]) == step
        for n, t in tp.items():
            e = rel_err(env[n], t.detach().numpy())
            worst = max(worst, e)
            assert e <= TOL, f"step {step}: param {n!r} relative error {e:.3e}"
        for k, (names, _, _) in enumerate(opt.groups):
            for slot in opt.slots:
                ref = np.concatenate([topt.state[tp[n]][TORCH_STATE_SLOTS[slot]].detach()
                                      .numpy().reshape(-1) for n in names])
                e = rel_err(env[f"optim.{slot}.g{k}"], ref)
                assert e <= TOL, f"step {step}: state {slot} of group {k} rel. error {e:.3e}"
    if expect_clipped is not None:
        assert all((nrm > clip) == expect_clipped for nrm in norms), norms
    return worst


def single_group(cls, **kw):
    return lambda tp: (cls(list(tp.values()), foreach=False, **kw), None)


# ---------------------------------------------------------------------------------------------
# SGD


@pytest.mark.parametrize("kw", [
    dict(),
    dict(momentum=0.9),
    dict(momentum=0.9, nesterov=True),
    dict(momentum=0.9, dampening=0.3),
    dict(momentum=0.8, dampening=0.5, weight_decay=0.05),
    dict(weight_decay=0.1),
    dict(momentum=0.9, nesterov=True, weight_decay=0.02),
], ids=["plain", "momentum", "nesterov", "dampening", "dampening-wd", "wd", "nesterov-wd"])
def test_sgd_matches_torch(kw):
    run_against_torch(optim.SGD(0.1, **kw), single_group(torch.optim.SGD, lr=0.1, **kw))


# ---------------------------------------------------------------------------------------------
# Adam / AdamW


@pytest.mark.parametrize("kw", [
    dict(),
    dict(weight_decay=0.1),
    dict(betas=(0.3, 0.95), eps=1e-6),  # beta1 < 0.5: torch's other lerp branch
    dict(betas=(0.0, 0.5), weight_decay=0.01),
], ids=["plain", "wd", "betas-eps", "beta1-zero"])
def test_adam_matches_torch(kw):
    run_against_torch(optim.Adam(0.01, **kw), single_group(torch.optim.Adam, lr=0.01, **kw))


@pytest.mark.parametrize("kw", [dict(), dict(weight_decay=0.3, betas=(0.8, 0.99))],
                         ids=["default-wd", "wd-betas"])
def test_adamw_matches_torch(kw):
    run_against_torch(optim.AdamW(0.01, **kw), single_group(torch.optim.AdamW, lr=0.01, **kw))


# ---------------------------------------------------------------------------------------------
# clipping


@pytest.mark.parametrize("max_norm,clipped", [(0.05, True), (100.0, False)],
                         ids=["above-threshold", "below-threshold"])
@pytest.mark.parametrize("which", ["sgd", "adamw"])
def test_clip_grad_norm_matches_torch(max_norm, clipped, which):
    if which == "sgd":
        opt = optim.SGD(0.1, momentum=0.9, clip_grad_norm=max_norm)
        make = single_group(torch.optim.SGD, lr=0.1, momentum=0.9)
    else:
        opt = optim.AdamW(0.01, clip_grad_norm=max_norm)
        make = single_group(torch.optim.AdamW, lr=0.01)
    run_against_torch(opt, make, clip=max_norm, expect_clipped=clipped)


# ---------------------------------------------------------------------------------------------
# schedules


def warmup_cosine_factor(s, warmup, total, base, min_lr):
    """Independent formula (as a LambdaLR factor)."""
    if s < warmup:
        return s / warmup
    p = min(1.0, (s - warmup) / (total - warmup))
    return (min_lr + (base - min_lr) * 0.5 * (1 + math.cos(math.pi * p))) / base


@pytest.mark.parametrize("which", ["sgd", "adam"])
def test_warmup_cosine_matches_lambdalr(which):
    base, warm, total, min_lr = 0.05, 5, 15, 0.005  # 20 steps: warm-up, cosine, and past the end
    sch = optim.WarmupCosine(base, warm, total, min_lr)
    lam = lambda s: warmup_cosine_factor(s, warm, total, base, min_lr)

    def make(tp):
        cls = torch.optim.SGD if which == "sgd" else torch.optim.Adam
        kw = dict(momentum=0.9) if which == "sgd" else {}
        o = cls(list(tp.values()), lr=base, foreach=False, **kw)
        return o, torch.optim.lr_scheduler.LambdaLR(o, lam)

    opt = optim.SGD(sch, momentum=0.9) if which == "sgd" else optim.Adam(sch)
    run_against_torch(opt, make)


@pytest.mark.parametrize("which", ["sgd", "adamw"])
def test_step_lr_matches_torch(which):
    base, size, gamma = 0.05, 4, 0.5

    def make(tp):
        cls = torch.optim.SGD if which == "sgd" else torch.optim.AdamW
        o = cls(list(tp.values()), lr=base, foreach=False)
        return o, torch.optim.lr_scheduler.StepLR(o, size, gamma)

    sch = optim.StepLR(base, size, gamma)
    opt = optim.SGD(sch) if which == "sgd" else optim.AdamW(sch)
    run_against_torch(opt, make)


def test_constant_schedule_object_equals_float():
    run_against_torch(optim.Adam(optim.Constant(0.01)),
                      single_group(torch.optim.Adam, lr=0.01))


@pytest.mark.parametrize("sch,torch_sched", [
    (optim.Constant(0.3), None),
    (optim.WarmupCosine(0.3, 5, 15, 0.03),
     lambda o: torch.optim.lr_scheduler.LambdaLR(
         o, lambda s: warmup_cosine_factor(s, 5, 15, 0.3, 0.03))),
    (optim.WarmupCosine(0.3, 0, 10), None),
    (optim.WarmupCosine(0.3, 4, 4, 0.1), None),
    (optim.StepLR(0.3, 3, 0.7), lambda o: torch.optim.lr_scheduler.StepLR(o, 3, 0.7)),
], ids=["constant", "warmup-cosine", "no-warmup", "warmup-only", "step"])
def test_schedule_value_build_and_torch_agree(sch, torch_sched):
    g = mn.Graph()
    step = g.input("s", ())
    out = sch.build(step)
    assert out.shape == () and out.dtype == mn.f32
    o = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=sch.lr)
    ts = torch_sched(o) if torch_sched else None
    for s in range(40):
        v = sch.value(s)
        (b64,) = evaluate(g, [out], {"s": np.float64(s)}, dtype=np.float64)
        (b32,) = evaluate(g, [out], {"s": np.float32(s)}, dtype=np.float32)
        assert abs(float(b64) - v) <= 1e-15 * max(abs(v), 1.0), (s, float(b64), v)
        assert abs(float(b32) - v) <= 1e-6 * max(abs(v), 1.0), (s, float(b32), v)
        if ts is not None:
            t = o.param_groups[0]["lr"]
            assert abs(t - v) <= 1e-14 * max(abs(v), 1e-300), (s, t, v)
            o.step()
            ts.step()


def test_warmup_cosine_shape():
    s = optim.WarmupCosine(1.0, 10, 110, min_lr=0.1)
    assert s.value(0) == 0.0 and s.value(5) == 0.5 and s.value(10) == 1.0
    assert s.value(60) == pytest.approx(0.55)
    assert s.value(110) == pytest.approx(0.1) and s.value(1000) == pytest.approx(0.1)


# ---------------------------------------------------------------------------------------------
# per-parameter options


MULTS = {"fc1": 0.5, "fc1.bias": 2.0, "fc2.w": 0.1}  # longest prefix wins: fc1.bias -> 2.0


def mult_of(n):
    return {"fc1.weight": 0.5, "fc1.bias": 2.0, "fc2.weight": 0.1}.get(n, 1.0)


@pytest.mark.parametrize("which", ["sgd", "adam"])
def test_lr_multipliers_match_param_groups(which):
    base = 0.05

    def make(tp):
        groups = [{"params": [tp[n]], "lr": base * mult_of(n)} for n in tp]
        if which == "sgd":
            return torch.optim.SGD(groups, lr=base, momentum=0.9, foreach=False), None
        return torch.optim.Adam(groups, lr=base, foreach=False), None

    opt = (optim.SGD(base, momentum=0.9, lr_multipliers=MULTS) if which == "sgd"
           else optim.Adam(base, lr_multipliers=MULTS))
    run_against_torch(opt, make)
    assert {n: m for names, m, _ in opt.groups for n in names} == {
        n: mult_of(n) for n in PARAM_SHAPES}


NO_WD = ("fc1.bias", "fc2.bias", "scale")


@pytest.mark.parametrize("which", ["sgd", "adam", "adamw"])
def test_no_weight_decay_matches_param_groups(which):
    base, wd = 0.05, 0.2
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[which]
    ours = {"sgd": optim.SGD, "adam": optim.Adam, "adamw": optim.AdamW}[which]

    def make(tp):
        groups = [{"params": [tp[n] for n in tp if n not in NO_WD], "weight_decay": wd},
                  {"params": [tp[n] for n in tp if n in NO_WD], "weight_decay": 0.0}]
        return cls(groups, lr=base, foreach=False), None

    opt = ours(base, weight_decay=wd, no_weight_decay=NO_WD)
    run_against_torch(opt, make)
    assert [(names, decays) for names, _, decays in opt.groups] == [
        (("fc1.weight", "fc2.weight"), True), (("fc1.bias", "fc2.bias", "scale"), False)]


def test_everything_together():
    """AdamW + warm-up cosine + clipping + multipliers + no-decay, several groups."""
    base, wd, warm, total, clip = 0.02, 0.1, 3, 12, 0.5
    sch = optim.WarmupCosine(base, warm, total)
    opt = optim.AdamW(sch, weight_decay=wd, clip_grad_norm=clip, lr_multipliers=MULTS,
                      no_weight_decay=NO_WD)

    def make(tp):
        groups = [{"params": [tp[n]], "lr": base * mult_of(n),
                   "weight_decay": 0.0 if n in NO_WD else wd} for n in tp]
        o = torch.optim.AdamW(groups, lr=base, foreach=False)
        lam = lambda s: warmup_cosine_factor(s, warm, total, base, 0.0)
        return o, torch.optim.lr_scheduler.LambdaLR(o, lam)

    worst = run_against_torch(opt, make, clip=clip)
    assert worst <= TOL
    assert len(opt.groups) == 4  # (0.5,T) (2.0,F) (0.1,T) (1.0,F)


# ---------------------------------------------------------------------------------------------
# structure and errors


def test_groups_states_and_updates_layout():
    g, loss = build_graph()
    g2, grads = mn.grad(g, loss)
    opt = optim.Adam(1e-3, weight_decay=0.1, no_weight_decay=("scale",))
    updates = opt.apply(g2, grads)
    assert opt.groups == [(("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"), 1.0, True),
                          (("scale",), 1.0, False)]
    assert opt.state_names() == ["optim.step", "optim.exp_avg.g0", "optim.exp_avg_sq.g0",
                                 "optim.exp_avg.g1", "optim.exp_avg_sq.g1"]
    n0 = sum(int(np.prod(PARAM_SHAPES[n])) for n in opt.groups[0][0])
    assert g2.states["optim.exp_avg.g0"].shape == (n0,)
    assert g2.states["optim.exp_avg_sq.g1"].shape == (1,)
    assert g2.states["optim.step"].shape == () and g2.states["optim.step"].dtype == mn.f32
    assert list(updates) == list(PARAM_SHAPES) + opt.state_names()
    assert g2.updates == updates
    init = init_leaves(g2, 0)
    assert all(not init[s].any() for s in opt.state_names())


def test_sgd_without_momentum_keeps_only_step():
    g, loss = build_graph()
    g2, grads = mn.grad(g, loss)
    opt = optim.SGD(0.1)
    opt.apply(g2, grads)
    assert opt.state_names() == ["optim.step"]
    assert len(opt.groups) == 1


def test_subset_of_params_and_f16_group():
    g = mn.Graph()
    a = g.param("a", (3,), init=mn.init.normal())
    h = g.param("h", (2, 2), dtype=mn.f16, init=mn.init.normal())
    frozen = g.param("frozen", (2,), init=mn.init.normal())
    loss = (a * a).sum() + (h.cast(mn.f32) * 2.0).square().sum() + frozen.sum()
    g2, grads = mn.grad(g, loss, wrt=["a", "h"])
    opt = optim.SGD(0.1, momentum=0.5)
    updates = opt.apply(g2, grads)
    assert opt.groups == [(("a",), 1.0, False), (("h",), 1.0, False)]
    assert "frozen" not in updates
    assert g2.states["optim.momentum_buffer.g1"].dtype == mn.f32
    assert updates["h"].dtype == mn.f16
    env = init_leaves(g2, 0)
    vals = dict(zip(updates, evaluate(g2, list(updates.values()), env), strict=True))
    hv = env["h"].astype(np.float32)
    np.testing.assert_allclose(vals["h"], (hv - 0.1 * 8 * hv).astype(np.float16), rtol=1e-3)
    np.testing.assert_allclose(vals["a"], env["a"] * 0.8, rtol=1e-6)


@pytest.mark.parametrize("make,msg", [
    (lambda: optim.SGD(-0.1), "lr must be >= 0"),
    (lambda: optim.SGD(float("nan")), "finite"),
    (lambda: optim.SGD("0.1"), "real number"),
    (lambda: optim.SGD(0.1, momentum=-1), "momentum"),
    (lambda: optim.SGD(0.1, nesterov=True), "nesterov"),
    (lambda: optim.SGD(0.1, momentum=0.9, dampening=0.1, nesterov=True), "dampening == 0"),
    (lambda: optim.SGD(0.1, weight_decay=-1e-3), "weight_decay"),
    (lambda: optim.Adam(0.1, betas=(1.0, 0.999)), r"betas\[0\] must be < 1"),
    (lambda: optim.Adam(0.1, betas=(0.9, -0.1)), r"betas\[1\] must be >= 0"),
    (lambda: optim.Adam(0.1, betas=0.9), "pair"),
    (lambda: optim.Adam(0.1, eps=-1.0), "eps"),
    (lambda: optim.AdamW(0.1, clip_grad_norm=0.0), "clip_grad_norm must be > 0"),
    (lambda: optim.AdamW(0.1, lr_multipliers={1: 2.0}), "prefixes"),
    (lambda: optim.AdamW(0.1, lr_multipliers={"fc": -1.0}), "lr_multipliers"),
    (lambda: optim.AdamW(0.1, lr_multipliers=[("fc", 1.0)]), "dict"),
    (lambda: optim.AdamW(0.1, no_weight_decay="bias"), "tuple of name prefixes"),
    (lambda: optim.AdamW(0.1, no_weight_decay=(None,)), "strings"),
    (lambda: optim.Adam(optim.StepLR), "schedule instance"),
    (lambda: optim.WarmupCosine(1.0, 10, 5), "total_steps"),
    (lambda: optim.WarmupCosine(1.0, 1, 5, min_lr=2.0), "min_lr"),
    (lambda: optim.WarmupCosine(1.0, -1, 5), "warmup_steps"),
    (lambda: optim.StepLR(1.0, 0), "step_size"),
    (lambda: optim.StepLR(1.0, 2.5), "int"),
])
def test_bad_hyperparameters(make, msg):
    with pytest.raises(optim.OptimizerError, match=msg):
        make()
    assert issubclass(optim.OptimizerError, mn.GraphBuildError)
    assert issubclass(optim.OptimizerError, ValueError)


def test_bad_apply_arguments():
    g, loss = build_graph()
    g2, grads = mn.grad(g, loss)
    with pytest.raises(optim.OptimizerError, match="non-empty"):
        optim.SGD(0.1).apply(g2, {})
    with pytest.raises(optim.OptimizerError, match="'x' is not a parameter"):
        optim.SGD(0.1).apply(g2, {"x": grads["scale"]})
    with pytest.raises(optim.OptimizerError, match="use the graph returned by mn.grad"):
        optim.SGD(0.1).apply(g, grads)
    with pytest.raises(optim.OptimizerError, match="gradient of 'scale' is"):
        optim.SGD(0.1).apply(g2, {"scale": grads["fc1.bias"]})
    with pytest.raises(optim.OptimizerError, match="matches no parameter"):
        optim.SGD(0.1, lr_multipliers={"fc3": 2.0}).apply(g2, grads)
    with pytest.raises(optim.OptimizerError, match="matches no parameter"):
        optim.AdamW(0.1, no_weight_decay=("norm",)).apply(g2, grads)
    optim.SGD(0.1).apply(g2, grads)
    with pytest.raises(optim.OptimizerError, match="already has optimizer state"):
        optim.SGD(0.1).apply(g2, grads)


def test_bias_correction_is_accurate_in_float32():
    """1 - beta**t is built as -expm1(t * ln beta): in f32 it stays within a few ulp of the
    float64 value (1 - pow(beta, t) in f32 is off by ~1e-5 at t=1 for beta=0.999)."""
    import meganeura as mn
    from meganeura import reference
    from meganeura.optim import _bias_correction

    g = mn.Graph()
    t = g.input("t", (1000,))
    out = {b: _bias_correction(mn.ops, b, t) for b in (0.9, 0.999, 0.95)}
    steps = np.arange(1, 1001, dtype=np.float32)
    res = reference.evaluate(g, list(out.values()), {"t": steps}, np.float32)
    for (b, _), got in zip(out.items(), res):
        want = 1.0 - b ** steps.astype(np.float64)
        assert np.max(np.abs(got - want) / want) < 2e-6, b
