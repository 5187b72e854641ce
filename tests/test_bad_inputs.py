"""The bad-input catalogue ("nothing silent, nothing lost"): every way of holding meganeura
wrong that we know of, one row each.  A row asserts the error TYPE, that the MESSAGE names the
culprit (the feed, parameter, op, option or file), and — where a session exists — that the
session is UNCHANGED afterwards (parameters, optimizer states, step count).  Session rows run
on the reference backend and on wgpu (lavapipe in CI).  docs/robustness.md lists what is
checked where."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

import meganeura as mn
from meganeura.cli import main

BACKENDS = ["reference", "wgpu"]


@dataclass(frozen=True)
class Case:
    id: str
    run: Callable
    error: type
    names: str  # a regex the message must match: the culprit's name

    def param(self):
        return pytest.param(self, id=self.id)


def _check(case: Case, *args):
    with pytest.raises(case.error) as e:
        case.run(*args)
    assert isinstance(e.value, case.error)
    import re

    assert re.search(case.names, str(e.value)), f"{case.id}: {e.value!s} does not name " \
                                                 f"{case.names!r}"
    return e.value


# =============================================================================== sessions

X = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
Y = np.array([0, 1, 2, 3], np.int32)


def _x(v):
    """X with one bad value at (1, 2)."""
    x = X.copy()
    x[1, 2] = v
    return x


def _classifier(backend):
    g = mn.Graph("clf")
    x = g.input("x", (4, 8))
    y = g.input("y", (4,), dtype=mn.i32)
    logits = mn.nn.Linear(8, 5, name="fc")(g, x)
    s = mn.compile(g, loss=mn.ops.cross_entropy(logits, y), outputs={"logits": logits},
                   optimizer=mn.optim.AdamW(lr=0.1), backend=backend)
    s.init_params(seed=0)
    s.step(x=X, y=Y).loss  # noqa: B018  (non-zero optimizer state)
    return s


@pytest.fixture(scope="module", params=BACKENDS)
def session(request):
    if request.param == "wgpu":
        request.getfixturevalue("gpu")
    return _classifier(request.param)


def _zeros(s, name, dtype=np.float32, shape=None):
    return np.zeros(shape if shape is not None else s.program.persistent[name].shape, dtype)


FEED_CASES = [
    Case("missing-feed", lambda s, t: s.step(x=X), mn.FeedError, r"missing 'y'"),
    Case("unknown-feed", lambda s, t: s.step(x=X, y=Y, z=X), mn.FeedError, r"unknown 'z'"),
    Case("misspelt-feed", lambda s, t: s.step(X=X, y=Y), mn.FeedError, r"unknown 'X'.*'x'"),
    Case("feed-shape", lambda s, t: s.step(x=X[:, :7], y=Y), mn.FeedError, r"'x' has shape"),
    Case("feed-rank", lambda s, t: s.step(x=X.ravel(), y=Y), mn.FeedError, r"'x' has shape"),
    Case("feed-transposed", lambda s, t: s.step(x=X.T, y=Y), mn.FeedError, r"'x'.*\(8, 4\)"),
    Case("feed-batch-too-big", lambda s, t: s.step(x=np.vstack([X, X]), y=Y), mn.FeedError,
         r"'x'"),
    Case("feed-scalar", lambda s, t: s.step(x=1.0, y=Y), mn.FeedError, r"'x' has shape \(\)"),
    Case("feed-none", lambda s, t: s.step(x=None, y=Y), mn.FeedError, r"'x'"),
    Case("feed-int-for-float", lambda s, t: s.step(x=X.astype(np.int32), y=Y), mn.FeedError,
         r"'x' has dtype int32"),
    Case("feed-bool-for-float", lambda s, t: s.step(x=X > 0, y=Y), mn.FeedError,
         r"'x' has dtype bool"),
    Case("feed-strings", lambda s, t: s.step(x=np.full((4, 8), "a"), y=Y), mn.FeedError,
         r"'x' has dtype <U1"),
    Case("feed-objects", lambda s, t: s.step(x=np.full((4, 8), None), y=Y), mn.FeedError,
         r"'x' has dtype object"),
    Case("feed-complex", lambda s, t: s.step(x=X.astype(complex), y=Y), mn.FeedError,
         r"'x' has dtype complex"),
    Case("feed-uint8", lambda s, t: s.step(x=X.astype(np.uint8), y=Y), mn.FeedError,
         r"'x' has dtype uint8"),
    Case("feed-nan", lambda s, t: s.step(x=_x(np.nan), y=Y), mn.FeedError,
         r"'x' has 1 NaN/inf.*\(1, 2\)"),
    Case("feed-inf", lambda s, t: s.step(x=_x(np.inf), y=Y), mn.FeedError, r"'x'.*\(1, 2\)"),
    Case("feed-minus-inf", lambda s, t: s.step(x=_x(-np.inf), y=Y), mn.FeedError, r"'x'"),
    Case("feed-f64-overflows-f32", lambda s, t: s.step(x=_f64_big(), y=Y), mn.FeedError,
         r"'x'.*after conversion to f32"),
    Case("feed-all-nan", lambda s, t: s.step(x=np.full((4, 8), np.nan), y=Y), mn.FeedError,
         r"'x' has 32 NaN"),
    Case("labels-float", lambda s, t: s.step(x=X, y=Y.astype(np.float32)), mn.FeedError,
         r"'y' has dtype float32"),
    Case("labels-bool", lambda s, t: s.step(x=X, y=Y > 1), mn.FeedError, r"'y' has dtype bool"),
    Case("labels-too-big", lambda s, t: s.step(x=X, y=np.array([0, 1, 5, 1])), mn.FeedError,
         r"'y'.*5 at index \(2,\).*\[0, 5\)"),
    Case("labels-negative", lambda s, t: s.step(x=X, y=np.array([-1, 1, 2, 1])), mn.FeedError,
         r"'y'.*-1 at index \(0,\)"),
    Case("labels-beyond-i32", lambda s, t: s.step(x=X, y=np.array([2**40, 0, 0, 0])),
         mn.FeedError, r"'y' has values outside the i32 range"),
    Case("labels-uint32-beyond-i32", lambda s, t: s.step(x=X, y=np.full(4, 2**31, np.uint32)),
         mn.FeedError, r"'y' has values outside"),
    Case("labels-shape", lambda s, t: s.step(x=X, y=Y.reshape(4, 1)), mn.FeedError,
         r"'y' has shape \(4, 1\)"),
    Case("labels-list-of-floats", lambda s, t: s.step(x=X, y=[0.0, 1.0, 2.0, 3.0]),
         mn.FeedError, r"'y' has dtype float64"),
    Case("run-unknown-feed", lambda s, t: s.run(x=X, y=Y), mn.FeedError, r"unknown 'y'"),
    Case("run-missing-feed", lambda s, t: s.run(), mn.FeedError, r"missing 'x'"),
    Case("run-nan", lambda s, t: s.run(x=_x(np.nan)), mn.FeedError, r"'x'"),
    Case("run-shape", lambda s, t: s.run(x=X[:2]), mn.FeedError, r"'x' has shape \(2, 8\)"),
]


def _f64_big():
    x = X.astype(np.float64)
    x[1, 2] = 1e39
    return x


def _ckpt(s, tmp, name="good.safetensors"):
    path = tmp / name
    s.save(path)
    return path


def _corrupt(s, tmp, how):
    """A checkpoint of ``s`` broken in one way."""
    path = _ckpt(s, tmp, f"{how}.safetensors")
    raw = bytearray(path.read_bytes())
    if how == "truncated":
        raw = raw[: len(raw) // 2]
    elif how == "garbage":
        raw = bytearray(b"not a checkpoint at all" * 10)
    elif how == "bitflip":
        (n,) = struct.unpack("<Q", raw[:8])
        off = 8 + n + json.loads(raw[8:8 + n])["fc.weight"]["data_offsets"][0]
        raw[off + 5] ^= 0x10
    path.write_bytes(bytes(raw))
    return path


def _foreign(s, tmp, tensors=None, **meta):
    """A file with our format tag written by another writer (no checksums)."""
    from safetensors.numpy import save_file

    from meganeura.checkpoint import FORMAT

    st = s.get_state() if tensors is None else tensors
    st = {k: np.asarray(v).reshape(np.shape(v) or (1,)) for k, v in st.items()}
    info = {"format": FORMAT, "fingerprint": s.program.model_fingerprint, "step": "3",
            "scalars": "optim.step"}
    info.update(meta)
    path = tmp / "foreign.safetensors"
    save_file(st, str(path), metadata=info)
    return path


def _state_with(s, name, value):
    st = s.get_state()
    st[name] = value
    return st


def _other_graph_ckpt(tmp):
    g = mn.Graph("other")
    x = g.input("x", (4, 8))
    y = g.input("y", (4,), dtype=mn.i32)
    logits = mn.nn.Linear(8, 5, name="fc")(g, x.tanh())  # same tensors, different graph
    s = mn.compile(g, loss=mn.ops.cross_entropy(logits, y), optimizer=mn.optim.AdamW(lr=0.1),
                   backend="reference")
    s.step(x=X, y=Y)
    return _ckpt(s, tmp, "other.safetensors")


CHECKPOINT_CASES = [
    Case("load-missing-file", lambda s, t: s.load(t / "nope.safetensors"), mn.CheckpointError,
         r"nope\.safetensors' does not exist"),
    Case("load-directory", lambda s, t: s.load(t), mn.CheckpointError, r"is a directory"),
    Case("load-truncated", lambda s, t: s.load(_corrupt(s, t, "truncated")),
         mn.CheckpointError, r"truncated\.safetensors' is corrupt or truncated"),
    Case("load-garbage", lambda s, t: s.load(_corrupt(s, t, "garbage")), mn.CheckpointError,
         r"garbage\.safetensors'"),
    Case("load-bit-flip", lambda s, t: s.load(_corrupt(s, t, "bitflip")), mn.CheckpointError,
         r"checksum mismatch in tensors \['fc.weight'\]"),
    Case("load-other-graph", lambda s, t: s.load(_other_graph_ckpt(t)), mn.CheckpointError,
         r"other\.safetensors' was written by a different graph"),
    Case("load-missing-tensor", lambda s, t: s.load(_foreign(
        s, t, {k: v for k, v in s.get_state().items() if k != "fc.bias"})),
        mn.CheckpointError, r"missing tensors \['fc.bias'\]"),
    Case("load-extra-tensor", lambda s, t: s.load(_foreign(
        s, t, _state_with(s, "fc.extra", np.zeros(3, np.float32)))),
        mn.CheckpointError, r"unexpected tensors \['fc.extra'\]"),
    Case("load-wrong-shape", lambda s, t: s.load(_foreign(
        s, t, _state_with(s, "fc.weight", np.zeros((8, 5), np.float32)))),
        mn.CheckpointError, r"fc.weight: file float32\[8, 5\]"),
    Case("load-wrong-dtype", lambda s, t: s.load(_foreign(
        s, t, _state_with(s, "fc.bias", np.zeros(5, np.float64)))),
        mn.CheckpointError, r"fc.bias: file float64"),
    Case("load-nan-tensor", lambda s, t: s.load(_foreign(
        s, t, _state_with(s, "fc.bias", np.full(5, np.nan, np.float32)))),
        mn.CheckpointError, r"non-finite tensors: 'fc.bias'"),
    Case("load-negative-step", lambda s, t: s.load(_foreign(s, t, step="-3")),
         mn.CheckpointError, r"bad step '-3'"),
    Case("load-absurd-step", lambda s, t: s.load(_foreign(s, t, step="1e99")),
         mn.CheckpointError, r"bad step '1e99'"),
    Case("load-not-ours", lambda s, t: s.load(_foreign(s, t, format="someone-else")),
         mn.CheckpointError, r"not a meganeura checkpoint \(format 'someone-else'\)"),
    Case("save-to-directory", lambda s, t: s.save(t), mn.CheckpointError,
         r"cannot save checkpoint .*: it is a directory"),
    Case("save-under-a-file", lambda s, t: s.save(_ckpt(s, t, "f") / "x.safetensors"),
         OSError, r"cannot save checkpoint .*f/x\.safetensors'"),
]


def _w(s, value):
    return np.full(s.program.persistent["fc.weight"].shape, value)


SESSION_CASES = [
    Case("set-unknown-name", lambda s, t: s.set_params({"fc.wieght": _zeros(s, "fc.weight")}),
         mn.FeedError, r"unknown tensors \['fc.wieght'\]"),
    Case("set-not-a-dict", lambda s, t: s.set_params([_zeros(s, "fc.weight")]), mn.FeedError,
         r"set_params: expected a dict.*got list"),
    Case("set-wrong-shape", lambda s, t: s.set_params({"fc.weight": np.zeros((8, 5))}),
         mn.FeedError, r"'fc.weight' has shape \(8, 5\)"),
    Case("set-int-for-float", lambda s, t: s.set_params({"fc.weight": _w(s, 1)}), mn.FeedError,
         r"'fc.weight' has dtype int64"),
    Case("set-bool-for-float", lambda s, t: s.set_params({"fc.bias": np.ones(5, bool)}),
         mn.FeedError, r"'fc.bias' has dtype bool"),
    Case("set-nan", lambda s, t: s.set_params({"fc.weight": _w(s, np.nan)}), mn.FeedError,
         r"'fc.weight' has NaN/inf"),
    Case("set-inf-state", lambda s, t: s.set_params({"optim.exp_avg.g0": _zeros(
        s, "optim.exp_avg.g0") + np.inf}), mn.FeedError, r"'optim.exp_avg.g0' has NaN/inf"),
    Case("set-overflows-f32", lambda s, t: s.set_params({"fc.weight": _w(s, 1e39)}),
         mn.FeedError, r"'fc.weight' has NaN/inf values as f32"),
    Case("set-string", lambda s, t: s.set_params({"fc.bias": "zeros"}), mn.FeedError,
         r"'fc.bias' has shape \(\)"),
    Case("set-strict-missing", lambda s, t: s.set_params({"fc.bias": np.zeros(5, np.float32)},
                                                         strict=True),
         mn.FeedError, r"missing parameters \['fc.weight'\]"),
    Case("set-step-wrong-shape", lambda s, t: s.set_params({"optim.step": np.zeros(2)}),
         mn.FeedError, r"'optim.step' has shape \(2,\)"),
    Case("set-second-bad-writes-nothing", lambda s, t: s.set_params(
        {"fc.bias": np.ones(5, np.float32), "fc.weight": _w(s, np.nan)}),
        mn.FeedError, r"'fc.weight'"),
    Case("init-negative-seed", lambda s, t: s.init_params(seed=-1), mn.FeedError,
         r"seed must be a non-negative int, got -1"),
    Case("init-float-seed", lambda s, t: s.init_params(seed=1.5), mn.FeedError, r"seed.*1.5"),
    Case("init-string-seed", lambda s, t: s.init_params(seed="0"), mn.FeedError, r"seed.*'0'"),
]


@pytest.mark.parametrize("case", [c.param() for c in FEED_CASES + CHECKPOINT_CASES
                                  + SESSION_CASES])
def test_session_refuses_and_changes_nothing(session, case, tmp_path):
    before, count = session.get_state(), session.step_count
    _check(case, session, tmp_path)
    after = session.get_state()
    assert session.step_count == count, case.id
    for k, v in before.items():
        np.testing.assert_array_equal(after[k], v, err_msg=f"{case.id}: {k} changed")


def test_step_on_an_inference_session(gpu):
    for backend in BACKENDS:
        g = mn.Graph("inf")
        x = g.input("x", (2, 3))
        s = mn.compile(g, outputs={"y": mn.nn.Linear(3, 2, name="fc")(g, x)}, backend=backend)
        before = s.get_params()
        _check(Case("step-without-optimizer", lambda: s.step(x=np.zeros((2, 3), np.float32)),
                    mn.FeedError, r"step\(\): this session has no optimizer"))
        _check(Case("run-without-outputs", lambda: _train_only(backend).run(x=X), mn.FeedError,
                    r"run\(\): the session was compiled without outputs="))
        for k, v in s.get_params().items():
            np.testing.assert_array_equal(v, before[k])


def _train_only(backend):
    g = mn.Graph("t")
    x = g.input("x", (4, 8))
    loss = mn.nn.Linear(8, 1, name="fc")(g, x).square().mean()
    return mn.compile(g, loss=loss, optimizer=mn.optim.SGD(lr=0.1), backend=backend)


# =============================================================================== graph building


def _g():
    g = mn.Graph("b")
    return g, g.input("x", (4, 8)), g.input("y", (4,), dtype=mn.i32)


def _build(fn):
    def run():
        g, x, y = _g()
        fn(g, x, y)
    return run


GRAPH_CASES = [
    Case("duplicate-input", _build(lambda g, x, y: g.input("x", (2,))), mn.NameConflictError,
         r"duplicate name 'x'"),
    Case("param-shadows-input", _build(lambda g, x, y: g.param("y", (2,))),
         mn.NameConflictError, r"duplicate name 'y'.*already used by input"),
    Case("empty-name", _build(lambda g, x, y: g.param("", (2,))), mn.NameConflictError,
         r"name must be a non-empty string"),
    Case("negative-dim", _build(lambda g, x, y: g.input("a", (-1, 2))), mn.ShapeError,
         r"input 'a': invalid shape \(-1, 2\)"),
    Case("float-dim", _build(lambda g, x, y: g.param("w", (2.5, 2))), mn.ShapeError,
         r"param 'w': invalid shape"),
    Case("unknown-dtype", _build(lambda g, x, y: g.input("a", (2,), dtype="f64")),
         mn.DTypeError, r"input 'a': unknown dtype 'f64'"),
    Case("matmul-inner", _build(lambda g, x, y: x @ g.param("w", (7, 3))), mn.ShapeError,
         r"matmul: inner dimensions differ"),
    Case("linear-in-features", _build(lambda g, x, y: mn.nn.Linear(7, 3, name="fc")(g, x)),
         mn.ShapeError, r"matmul:.*\(4, 8\) @ \(3, 7\)"),
    Case("broadcast", _build(lambda g, x, y: x + g.param("b", (3,))), mn.ShapeError,
         r"add:.*f32\[4,8\], f32\[3\]"),
    Case("mixed-dtypes", _build(lambda g, x, y: x[:, 0] + y), mn.DTypeError, r"add"),
    Case("reshape-size", _build(lambda g, x, y: x.reshape(5, 7)), mn.ShapeError,
         r"reshape: cannot reshape \(4, 8\)"),
    Case("reshape-two-minus-one", _build(lambda g, x, y: x.reshape(-1, -1)), mn.ShapeError,
         r"reshape: only one -1"),
    Case("permute-not-a-permutation", _build(lambda g, x, y: x.permute(0, 0)), mn.AxisError,
         r"permute: perm \(0, 0\)"),
    Case("sum-axis-range", _build(lambda g, x, y: x.sum(5)), mn.AxisError,
         r"sum: axis 5 is out of range"),
    Case("sum-repeated-axis", _build(lambda g, x, y: x.sum((1, 1))), mn.AxisError,
         r"sum: repeated axis"),
    Case("softmax-axis", _build(lambda g, x, y: mn.ops.softmax(x, 2)), mn.AxisError,
         r"softmax"),
    Case("concat-shapes", _build(lambda g, x, y: mn.ops.concat([x, g.param("p", (4, 2, 1))], 1)),
         mn.ShapeError, r"concat"),
    Case("concat-nothing", _build(lambda g, x, y: mn.ops.concat([], 0)), mn.ShapeError,
         r"concat: needs at least one operand"),
    Case("split-sizes", _build(lambda g, x, y: mn.ops.split(x, [3, 3], 1)), mn.ShapeError,
         r"split: sizes \(3, 3\) do not add up"),
    Case("slice-step-zero", _build(lambda g, x, y: x[::0]), mn.ShapeError,
         r"slice: step must be positive"),
    Case("index-with-array", _build(lambda g, x, y: x[np.array([0, 1])]), mn.GraphBuildError,
         r"getitem: index array.*mn.ops.take"),
    Case("too-many-indices", _build(lambda g, x, y: x[0, 0, 0]), mn.ShapeError,
         r"getitem: too many indices"),
    Case("where-float-condition", _build(lambda g, x, y: mn.ops.where(x, x, x)), mn.DTypeError,
         r"where: condition must be bool"),
    Case("xent-float-labels", _build(lambda g, x, y: mn.ops.cross_entropy(x, x)), mn.DTypeError,
         r"cross_entropy: labels must be integer"),
    Case("xent-label-shape", _build(lambda g, x, y: mn.ops.cross_entropy(
        x, g.input("l", (5,), dtype=mn.i32))), mn.ShapeError, r"cross_entropy"),
    Case("xent-smoothing", _build(lambda g, x, y: mn.ops.cross_entropy(x, y,
                                                                      label_smoothing=2.0)),
         mn.GraphBuildError, r"cross_entropy: label_smoothing must be in \[0, 1\]"),
    Case("xent-reduction", _build(lambda g, x, y: mn.ops.cross_entropy(x, y, reduction="avg")),
         mn.GraphBuildError, r"cross_entropy: reduction must be one of"),
    Case("mse-shapes", _build(lambda g, x, y: mn.ops.mse_loss(x, x[:2])), mn.ShapeError,
         r"mse_loss: prediction and target differ"),
    Case("add-a-string", _build(lambda g, x, y: x + "a"), mn.GraphBuildError,
         r"add: cannot combine a graph Value with str"),
    Case("two-graphs", _build(lambda g, x, y: x + mn.Graph("o").input("z", (4, 8))),
         mn.GraphBuildError, r"add: operand .* belongs to another graph"),
    Case("embedding-float-ids", _build(lambda g, x, y: mn.ops.embedding(
        x, g.param("tab", (10, 4)))), mn.DTypeError, r"embedding: ids must be integers"),
    Case("conv-channels", _build(lambda g, x, y: mn.ops.conv2d(
        g.input("im", (1, 3, 8, 8)), g.param("k", (4, 2, 3, 3)))), mn.ShapeError,
         r"conv2d: weight expects 2 .* input has 3"),
    Case("attention-head-dims", _build(lambda g, x, y: mn.ops.attention(
        g.input("q", (1, 2, 4, 8)), g.input("kk", (1, 2, 4, 6)), g.input("v", (1, 2, 4, 6)))),
         mn.GraphBuildError, r"attention"),
    Case("set-update-unknown", _build(lambda g, x, y: g.set_update("nope", x)),
         mn.GraphBuildError, r"set_update: 'nope' is not a parameter or state"),
    Case("set-update-input", _build(lambda g, x, y: g.set_update("x", x)), mn.GraphBuildError,
         r"set_update: 'x' is not a parameter or state"),
    Case("set-update-shape", _build(lambda g, x, y: (g.state("s", (2,)), g.set_update("s", x))),
         mn.ShapeError, r"set_update: new value for 's'"),
    Case("grad-non-scalar", _build(lambda g, x, y: mn.grad(g, x)), mn.AutodiffError,
         r"grad: loss must be a scalar"),
    Case("grad-wrt-input", _build(lambda g, x, y: mn.grad(g, (x * g.param("w", (8,))).sum(),
                                                          wrt=["x"])),
         mn.AutodiffError, r"grad: 'x' is not a parameter of the graph \(input\)"),
    Case("grad-wrt-unknown", _build(lambda g, x, y: mn.grad(g, (x * g.param("w", (8,))).sum(),
                                                            wrt=["nope"])),
         mn.AutodiffError, r"'nope' is not a parameter"),
    Case("value-as-bool", _build(lambda g, x, y: bool(x > 0)), TypeError, r"no truth value"),
]


@pytest.mark.parametrize("case", [c.param() for c in GRAPH_CASES])
def test_graph_building_names_the_op(case):
    _check(case)


# =============================================================================== compile


def _net():
    g, x, y = _g()
    logits = mn.nn.Linear(8, 5, name="fc")(g, x)
    return g, logits, mn.ops.cross_entropy(logits, y)


def _compile(backend="reference", optimizer="sgd", **kw):
    def run():
        g, logits, loss = _net()
        opt = mn.optim.SGD(lr=0.1) if optimizer == "sgd" else optimizer
        mn.compile(g, loss=loss, optimizer=opt, backend=backend, **kw)
    return run


def _compile_other(**kw):
    def run():
        g, logits, loss = _net()
        args = {"loss": loss, "optimizer": mn.optim.SGD(lr=0.1), "backend": "reference"}
        args.update({k: (v(g, logits, loss) if callable(v) else v) for k, v in kw.items()})
        mn.compile(g, **args)
    return run


COMPILE_CASES = [
    Case("unknown-option", _compile(fuze=False), mn.GraphBuildError, r"unknown option.*'fuze'"),
    Case("gpu-option-on-reference", _compile(plan_memory=False), mn.GraphBuildError,
         r"\['plan_memory'\] for the reference backend"),
    Case("precision", _compile(precision="fastest"), mn.GraphBuildError,
         r"precision must be one of .* 'fastest'"),
    Case("backend", _compile(backend="cuda"), mn.DeviceError, r"'cuda'"),
    Case("reference-int-dtype", _compile(dtype=np.int32), mn.GraphBuildError,
         r"dtype must be np.float32 or np.float64"),
    Case("reference-f16-dtype", _compile(dtype="float16"), mn.GraphBuildError,
         r"dtype .* got 'float16'"),
    Case("tune", _compile(backend="wgpu", tune="sometimes"), mn.GraphBuildError,
         r"tune must be .* 'sometimes'"),
    Case("nan-check", _compile(nan_check="always"), mn.GraphBuildError,
         r"nan_check must be one of .* 'always'"),
    Case("nan-check-inference", _compile_other(optimizer=None, loss=None, nan_check="step",
                                               outputs=lambda g, lo, ls: {"l": lo}),
         mn.GraphBuildError, r"nan_check='step'.*needs loss= and optimizer="),
    Case("not-a-graph", lambda: mn.compile("graph", outputs={}), mn.GraphBuildError,
         r"expected a Graph, got str"),
    Case("output-not-a-value", _compile_other(outputs={"logits": np.zeros(3)}),
         mn.GraphBuildError, r"output 'logits' is not a value of this graph"),
    Case("output-of-another-graph", _compile_other(outputs={"o": _net()[1]}),
         mn.GraphBuildError, r"output 'o' is not a value"),
    Case("loss-of-another-graph", _compile_other(loss=_net()[2]), mn.GraphBuildError,
         r"loss is not a value of this graph"),
    Case("optimizer-without-loss", _compile_other(loss=None, outputs=lambda g, lo, ls: {
        "l": lo}), mn.GraphBuildError, r"an optimizer needs a loss"),
    Case("nothing-to-compute", _compile_other(loss=None, optimizer=None), mn.GraphBuildError,
         r"nothing to compute"),
    Case("non-scalar-loss", _compile_other(loss=lambda g, lo, ls: lo), mn.AutodiffError,
         r"loss must be a scalar"),
    Case("share-with-other-backend", lambda: _compile_share(), mn.GraphBuildError,
         r"share: cannot share tensors between a GPUSession and a ReferenceSession"),
    Case("empty-input-on-gpu", lambda: _empty_input(), mn.GraphBuildError,
         r"input 'e' \(f32\[0,8\]\) has no elements"),
    Case("tensor-beyond-binding-limit", lambda: _huge_param(), mn.LimitError, r"'huge'"),
]


def _compile_share():
    g, logits, loss = _net()
    mn.compile(g, loss=loss, optimizer=mn.optim.SGD(lr=0.1), share=_train_only("reference"))


def _empty_input():
    g = mn.Graph("empty")
    e = g.input("e", (0, 8))
    mn.compile(g, outputs={"y": mn.nn.Linear(8, 2, name="fc")(g, e)})


def _huge_param():
    """A parameter larger than the device lets one binding address (lavapipe: 2 GiB)."""
    from meganeura.runtime.device import get_device

    limit = get_device().limits["max_storage_buffer_binding_size"]
    g = mn.Graph("huge")
    x = g.input("x", (1,))
    p = g.param("huge", (limit // 4 + 1,))
    mn.compile(g, outputs={"y": p[:1] * x})


@pytest.mark.parametrize("case", [c.param() for c in COMPILE_CASES])
def test_compile_names_the_option(gpu, case):
    _check(case)


# =============================================================================== optimizers

O = mn.optim
OPTIMIZER_CASES = [
    Case("sgd-negative-lr", lambda: O.SGD(lr=-1.0), O.OptimizerError, r"SGD: lr must be >= 0"),
    Case("sgd-nan-lr", lambda: O.SGD(lr=float("nan")), O.OptimizerError, r"SGD: lr .*finite"),
    Case("sgd-string-lr", lambda: O.SGD(lr="0.1"), O.OptimizerError,
         r"SGD: lr must be a real number, got '0.1'"),
    Case("sgd-bool-lr", lambda: O.SGD(lr=True), O.OptimizerError, r"SGD: lr must be a real"),
    Case("sgd-negative-momentum", lambda: O.SGD(lr=0.1, momentum=-0.5), O.OptimizerError,
         r"SGD: momentum must be >= 0"),
    Case("sgd-nesterov-without-momentum", lambda: O.SGD(lr=0.1, nesterov=True),
         O.OptimizerError, r"nesterov=True requires momentum > 0"),
    Case("adam-inf-lr", lambda: O.Adam(lr=float("inf")), O.OptimizerError,
         r"Adam: lr must be finite"),
    Case("adam-beta1-one", lambda: O.Adam(betas=(1.0, 0.999)), O.OptimizerError,
         r"Adam: betas\[0\] must be < 1"),
    Case("adam-beta2-negative", lambda: O.Adam(betas=(0.9, -0.1)), O.OptimizerError,
         r"Adam: betas\[1\] must be >= 0"),
    Case("adam-betas-not-a-pair", lambda: O.Adam(betas=(0.9,)), O.OptimizerError,
         r"Adam: betas must be a pair"),
    Case("adam-negative-eps", lambda: O.Adam(eps=-1e-8), O.OptimizerError, r"Adam: eps"),
    Case("adamw-negative-weight-decay", lambda: O.AdamW(weight_decay=-0.1), O.OptimizerError,
         r"AdamW: weight_decay must be >= 0"),
    Case("clip-zero", lambda: O.Adam(clip_grad_norm=0.0), O.OptimizerError,
         r"Adam: clip_grad_norm must be > 0"),
    Case("schedule-class", lambda: O.SGD(lr=O.Constant), O.OptimizerError,
         r"SGD: lr must be a number or a schedule instance, got the class Constant"),
    Case("cosine-total-before-warmup", lambda: O.WarmupCosine(1e-3, 100, 10), O.OptimizerError,
         r"WarmupCosine: total_steps \(10\) must be >= warmup_steps \(100\)"),
    Case("cosine-min-lr-above-lr", lambda: O.WarmupCosine(1e-3, 1, 10, min_lr=1.0),
         O.OptimizerError, r"WarmupCosine: min_lr must be <= 0.001"),
    Case("cosine-float-steps", lambda: O.WarmupCosine(1e-3, 1.5, 10), O.OptimizerError,
         r"WarmupCosine: warmup_steps must be an int, got 1.5"),
    Case("steplr-step-size-zero", lambda: O.StepLR(0.1, 0), O.OptimizerError,
         r"StepLR: step_size must be >= 1"),
    Case("schedule-negative-step", lambda: O.StepLR(0.1, 2).value(-1), O.OptimizerError,
         r"StepLR.value\(step\) must be >= 0"),
    Case("no-weight-decay-string", lambda: O.AdamW(no_weight_decay="fc"), O.OptimizerError,
         r"no_weight_decay must be a tuple of name prefixes, got the string 'fc'"),
    Case("lr-multiplier-key", lambda: O.SGD(lr=0.1, lr_multipliers={1: 2.0}),
         O.OptimizerError, r"lr_multipliers: keys must be parameter-name prefixes"),
    Case("lr-multiplier-value", lambda: O.SGD(lr=0.1, lr_multipliers={"fc": -2.0}),
         O.OptimizerError, r"lr_multipliers\['fc'\] must be >= 0"),
    Case("lr-multiplier-matches-nothing", _compile(optimizer=O.SGD(lr=0.1,
                                                                   lr_multipliers={"fx": 2.0})),
         O.OptimizerError, r"lr_multipliers prefix 'fx' matches no parameter"),
    Case("no-weight-decay-matches-nothing", _compile(optimizer=O.AdamW(no_weight_decay=("b",))),
         O.OptimizerError, r"no_weight_decay prefix 'b' matches no parameter"),
    Case("apply-twice", lambda: _apply_twice(), O.OptimizerError,
         r"already has optimizer state 'optim.step'"),
    Case("apply-to-an-input", lambda: O.SGD(lr=0.1).apply(*_grads_with("x")), O.OptimizerError,
         r"'x' is not a parameter of the graph \(input\)"),
    Case("apply-bad-guard", lambda: O.SGD(lr=0.1).apply(*_grads_with(None), guard=True),
         O.OptimizerError, r"guard must be a bool scalar"),
]


def _grads_with(extra):
    g, logits, loss = _net()
    g2, grads = mn.grad(g, loss)
    if extra is not None:
        grads = dict(grads, **{extra: grads["fc.bias"]})
    return g2, grads


def _apply_twice():
    g2, grads = _grads_with(None)
    O.SGD(lr=0.1).apply(g2, grads)
    O.SGD(lr=0.1).apply(g2, grads)


@pytest.mark.parametrize("case", [c.param() for c in OPTIMIZER_CASES])
def test_optimizer_names_the_hyperparameter(case):
    _check(case)


# =============================================================================== CLI


CLI_CASES = [
    (["train", "--epochs", "0"], 2, "--epochs"),
    (["train", "--epochs", "two"], 2, "--epochs"),
    (["train", "--batch-size", "-4"], 2, "--batch-size"),
    (["train", "--lr", "inf"], 2, "--lr"),
    (["train", "--lr", "-0.1"], 2, "--lr"),
    (["train", "--weight-decay", "nan"], 2, "--weight-decay"),
    (["train", "--seed", "1.5"], 2, "--seed"),
    (["train", "--backend", "cuda"], 2, "'cuda'"),
    (["train", "--precision", "double"], 2, "--precision"),
    (["train", "--min-accuracy", "95"], 2, "--min-accuracy"),
    (["train", "--model", "transformer"], 2, "--model"),
    (["train", "--epocs", "3"], 2, "--epocs"),
    (["profile", "--steps", "0"], 2, "--steps"),
    (["info", "--backend", "reference"], 2, "--backend"),
    (["frobnicate"], 2, "frobnicate"),
]


@pytest.mark.parametrize("argv, rc, culprit", CLI_CASES,
                         ids=["cli:" + " ".join(a) for a, _, _ in CLI_CASES])
def test_cli_is_one_line_naming_the_argument(argv, rc, culprit, capsys):
    try:
        got = main(argv)
    except SystemExit as e:
        got = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert got == rc and len(lines) == 1 and "Traceback" not in err, err
    assert culprit in lines[0], lines[0]


def test_cli_settings_found_before_training(tmp_path, capsys, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    ref = ["train", "--backend", "reference", "--quiet"]
    cases = [
        (ref + ["--out", str(afile)], "--out"),
        (ref + ["--out", str(tmp_path / "run"), "--resume"], "no checkpoint"),
        (ref + ["--out", str(tmp_path), "--batch-size", "100000"], "--batch-size 100000"),
    ]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "mlp.safetensors").write_bytes(b"garbage")
    cases.append((ref + ["--out", str(bad), "--resume"], "mlp.safetensors"))
    for argv, culprit in cases:
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
        err = capsys.readouterr().err
        assert rc in (1, 2) and culprit in err and "Traceback" not in err, (argv, err)
    monkeypatch.setenv("MEGANEURA_WEBGPU", "cuda")
    assert main(["info"]) == 2 and "MEGANEURA_WEBGPU" in capsys.readouterr().err
    assert os.listdir(bad) == ["mlp.safetensors"]  # nothing written beside the bad file
