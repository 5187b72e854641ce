"""The typed static graph: values with static shapes and dtypes, nodes applying registered ops.

``graph.py`` owns the op registry but knows no op family: each ``ops/`` module registers its
``OpDef``s (type rule, numpy reference, VJP, lowering) and its builder functions, and ``Value``
operators dispatch to those builders by op name.  A graph is append-only while it is built;
compiler stages work on copies (``Graph.copy`` keeps value ids, so ``new_graph[v]`` maps a value
of the original onto the copy).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .dtypes import DType, as_dtype, bool_, f32
from .errors import DTypeError, GraphBuildError, NameConflictError, ShapeError

Shape = tuple[int, ...]

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class TensorType:
    shape: Shape
    dtype: DType

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(int(d) for d in self.shape)  # exact, and no numpy call per query

    def __str__(self) -> str:
        return f"{self.dtype.name}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class OpDef:
    """Everything about one op, in one place.

    infer(types, attrs) -> list[TensorType]        type rule; raises ShapeError/DTypeError/AxisError
    reference(arrays, attrs) -> list[np.ndarray]    numpy semantics; must keep the input float dtype
    vjp(node, cotangents) -> list[Value | None]     backward, built from other ops (None: no grad)
    lowering: data for codegen (see codegen/), or None when a pass rewrites the op away first
    """

    name: str
    infer: Callable[[list[TensorType], dict], list[TensorType]]
    reference: Callable[[list[np.ndarray], dict], list[np.ndarray]] | None
    vjp: Callable[..., list] | None = None
    lowering: Any = None
    leaf: bool = False  # inputs/params/states/constants: values supplied from outside
    # operand_ranges(in_types, attrs) -> {operand index: ValueRange}: integer operands whose
    # values must lie in a range (class labels).  Fed inputs are checked on the host before a
    # step on every backend, since a GPU kernel cannot raise an error.
    operand_ranges: Callable[[list[TensorType], dict], dict] | None = None


@dataclass(frozen=True)
class ValueRange:
    """Values an integer operand may hold: ``lo <= v < hi``, or one of ``also`` (an
    ``ignore_index``); ``what`` names them in errors ("cross_entropy label")."""

    lo: int
    hi: int
    also: tuple[int, ...] = ()
    what: str = "value"

    def first_violation(self, arr: np.ndarray) -> tuple[int, ...] | None:
        """Index of the first element outside the range, or None."""
        bad = (arr < self.lo) | (arr >= self.hi)
        for v in self.also:
            bad &= arr != v
        if not bad.any():
            return None
        return tuple(int(i) for i in np.argwhere(bad)[0])


_OPS: dict[str, OpDef] = {}
_BUILDERS: dict[str, Callable[..., Any]] = {}


def register_op(op: OpDef) -> OpDef:
    if op.name in _OPS:
        raise RuntimeError(f"op {op.name!r} registered twice")
    _OPS[op.name] = op
    return op


def get_op(name: str) -> OpDef:
    try:
        return _OPS[name]
    except KeyError:
        raise GraphBuildError(f"unknown op {name!r}") from None


def registered_ops() -> dict[str, OpDef]:
    return dict(_OPS)


def register_builder(name: str, fn: Callable[..., Any] | None = None):
    """Register the user-facing builder used by ``Value`` methods/operators (decorator form too)."""

    def deco(f):
        _BUILDERS[name] = f
        return f

    return deco(fn) if fn is not None else deco


def builder(name: str) -> Callable[..., Any]:
    if name not in _BUILDERS:
        from . import ops  # noqa: F401  (registers every family on first use)
    return _BUILDERS[name]


@functools.lru_cache(maxsize=4096)
def _inside_package(filename: str) -> bool:
    """Is this source file part of meganeura?  Cached: graph building asks it for every frame
    of every op, and ``abspath`` dominated the time of rebuilding large graphs."""
    return os.path.abspath(filename).startswith(_PKG_DIR)


def _user_location() -> str:
    """file:line of the first stack frame outside this package: where the user built the op."""
    f = sys._getframe(2)
    while f is not None and _inside_package(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return "?"
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


class Value:
    """A symbolic tensor: the ``index``-th output of ``node`` in ``graph``.

    Arithmetic operators and methods build new nodes.  ``==`` keeps Python identity semantics (so
    values can key dicts); use ``.eq()``/``.ne()`` for elementwise comparison.
    """

    __slots__ = ("graph", "id", "type", "node", "index")
    __array_ufunc__ = None  # numpy scalars/arrays defer to our reflected operators

    def __init__(self, graph: Graph, vid: int, type_: TensorType, node: Node, index: int):
        self.graph = graph
        self.id = vid
        self.type = type_
        self.node = node
        self.index = index

    shape = property(lambda self: self.type.shape)
    dtype = property(lambda self: self.type.dtype)
    ndim = property(lambda self: len(self.type.shape))
    size = property(lambda self: self.type.size)

    def __repr__(self) -> str:
        return f"%{self.id}:{self.type}"

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    def __bool__(self) -> bool:
        raise TypeError(
            f"the symbolic value {self!r} has no truth value; use mn.ops.where / comparisons"
        )

    # arithmetic ---------------------------------------------------------------------------
    def __add__(self, o):
        return builder("add")(self, o)

    def __radd__(self, o):
        return builder("add")(o, self)

    def __sub__(self, o):
        return builder("sub")(self, o)

    def __rsub__(self, o):
        return builder("sub")(o, self)

    def __mul__(self, o):
        return builder("mul")(self, o)

    def __rmul__(self, o):
        return builder("mul")(o, self)

    def __truediv__(self, o):
        return builder("div")(self, o)

    def __rtruediv__(self, o):
        return builder("div")(o, self)

    def __pow__(self, o):
        return builder("pow")(self, o)

    def __rpow__(self, o):
        return builder("pow")(o, self)

    def __matmul__(self, o):
        return builder("matmul")(self, o)

    def __rmatmul__(self, o):
        return builder("matmul")(o, self)

    def __neg__(self):
        return builder("neg")(self)

    def __abs__(self):
        return builder("abs")(self)

    def __lt__(self, o):
        return builder("less")(self, o)

    def __le__(self, o):
        return builder("less_equal")(self, o)

    def __gt__(self, o):
        return builder("greater")(self, o)

    def __ge__(self, o):
        return builder("greater_equal")(self, o)

    def eq(self, o):
        return builder("equal")(self, o)

    def ne(self, o):
        return builder("not_equal")(self, o)

    def __getitem__(self, idx):
        return builder("getitem")(self, idx)

    # methods ------------------------------------------------------------------------------
    def __getattr__(self, name: str):
        # Unary elementwise ops and other single-tensor builders as methods: x.relu(), x.exp() …
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            fn = builder(name)
        except KeyError:
            raise AttributeError(f"Value has no method or op named {name!r}") from None
        return lambda *a, **k: fn(self, *a, **k)

    @property
    def T(self) -> Value:
        """Swap the last two axes (matrix transpose; batch axes kept)."""
        return builder("matrix_transpose")(self)


@dataclass(eq=False)
class Node:
    id: int
    op: str
    inputs: tuple[Value, ...]
    attrs: dict
    outputs: tuple[Value, ...] = ()
    loc: str = "?"

    @property
    def opdef(self) -> OpDef:
        return get_op(self.op)

    @property
    def out(self) -> Value:
        return self.outputs[0]


@dataclass
class Leaf:
    """An input, parameter, state or constant: a value supplied from outside the op DAG."""

    kind: str  # "input" | "param" | "state" | "constant"
    name: str
    value: Value
    init: Any = None  # initializer (params, states)
    trainable: bool = False
    data: np.ndarray | None = field(default=None, repr=False)  # constants


_LEAF_KINDS = ("input", "param", "state", "constant")


class Graph:
    """A typed static graph.  Build it with ``input``/``param``/``state``/``const`` and ops."""

    def __init__(self, name: str = "graph"):
        self.name = name
        self.nodes: list[Node] = []
        self.values: list[Value] = []
        self.leaves: dict[str, Leaf] = {}
        self.updates: dict[str, Value] = {}  # persistent name -> its new value after a step

    # leaves ----------------------------------------------------------------------------------
    def _leaf(self, kind: str, name: str, shape, dtype, **extra) -> Value:
        if not isinstance(name, str) or not name:
            raise NameConflictError(f"{kind} name must be a non-empty string, got {name!r}")
        shape = _as_shape(shape, f"{kind} {name!r}")
        try:
            dt = as_dtype(dtype)
        except DTypeError as e:
            raise DTypeError(f"{kind} {name!r}: {e}") from None
        if name in self.leaves:
            other = self.leaves[name]
            raise NameConflictError(
                f"{kind}: duplicate name {name!r} for {kind} {TensorType(shape, dt)}: already used "
                f"by {other.kind} {other.value.type} (at {_user_location()})"
            )
        v = self._add_node(kind, (), {"name": name}, [TensorType(shape, dt)])[0]
        self.leaves[name] = Leaf(kind, name, v, **extra)
        return v

    def input(self, name: str, shape: Sequence[int], dtype: DType | str = f32) -> Value:
        """A value fed at every step/run (data, labels)."""
        return self._leaf("input", name, shape, dtype)

    def param(self, name: str, shape: Sequence[int], dtype: DType | str = f32, init=None) -> Value:
        """A trainable parameter.  ``init`` is an initializer from ``mn.init`` (default zeros)."""
        from .init import zeros

        return self._leaf("param", name, shape, dtype, init=init or zeros(), trainable=True)

    def state(self, name: str, shape: Sequence[int], dtype: DType | str = f32, init=None) -> Value:
        """Persistent non-trainable tensor (optimizer moments, running statistics, step count)."""
        from .init import zeros

        return self._leaf("state", name, shape, dtype, init=init or zeros())

    def const(self, data, dtype: DType | str | None = None, name: str | None = None) -> Value:
        """An embedded constant tensor (stored in the graph, uploaded once)."""
        arr = np.asarray(data)
        dt = as_dtype(dtype if dtype is not None else arr.dtype)
        arr = np.ascontiguousarray(arr.astype(dt.np))
        name = name or f"const{len(self.leaves)}"
        return self._leaf("constant", name, arr.shape, dt, data=arr)

    def scalar(self, value: float | int | bool, dtype: DType | str = f32) -> Value:
        """A rank-0 constant folded into kernels (no buffer)."""
        return self.full((), value, dtype)

    def full(self, shape: Sequence[int], value: float | int | bool, dtype: DType | str = f32):
        dt = as_dtype(dtype)
        shape = _as_shape(shape, "full")
        value = bool(value) if dt is bool_ else (float(value) if dt.is_float else int(value))
        return self.apply("full", shape=shape, value=value, dtype=dt)

    def set_update(self, name: str, value: Value) -> None:
        """After each step the persistent tensor ``name`` (param or state) takes ``value``."""
        leaf = self.leaves.get(name)
        if leaf is None or leaf.kind not in ("param", "state"):
            raise GraphBuildError(f"set_update: {name!r} is not a parameter or state of the graph")
        self._check_owned(value, "set_update")
        if value.type != leaf.value.type:
            raise ShapeError(
                f"set_update: new value for {name!r} is {value.type}, expected {leaf.value.type}"
            )
        self.updates[name] = value

    # views of the leaves -----------------------------------------------------------------------
    def _kind(self, kind: str) -> dict[str, Value]:
        return {n: lf.value for n, lf in self.leaves.items() if lf.kind == kind}

    @property
    def inputs(self) -> dict[str, Value]:
        return self._kind("input")

    @property
    def params(self) -> dict[str, Value]:
        return self._kind("param")

    @property
    def states(self) -> dict[str, Value]:
        return self._kind("state")

    @property
    def constants(self) -> dict[str, np.ndarray]:
        return {n: lf.data for n, lf in self.leaves.items() if lf.kind == "constant"}

    def leaf_of(self, v: Value) -> Leaf | None:
        if v.node.op in _LEAF_KINDS:
            return self.leaves[v.node.attrs["name"]]
        return None

    # building ----------------------------------------------------------------------------------
    def _check_owned(self, v: object, op: str) -> None:
        if not isinstance(v, Value):
            raise GraphBuildError(f"{op}: expected a graph Value, got {type(v).__name__} "
                                  f"(at {_user_location()})")
        if v.graph is not self:
            raise GraphBuildError(f"{op}: operand {v!r} belongs to another graph (graph "
                                  f"{v.graph.name!r}, not {self.name!r}; at {_user_location()})")

    def apply(self, op: str, *inputs: Value, **attrs) -> Any:
        """Add a node applying ``op``; returns its Value (or a tuple when it has several)."""
        opdef = get_op(op)
        for v in inputs:
            self._check_owned(v, op)
        types = [v.type for v in inputs]
        try:
            out_types = opdef.infer(types, attrs)
        except GraphBuildError as e:
            operands = ", ".join(str(t) for t in types) or "none"
            raise type(e)(f"{op}: {e} (operands: {operands}; at {_user_location()})") from None
        outs = self._add_node(op, tuple(inputs), attrs, out_types)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _add_node(self, op, inputs, attrs, out_types, loc=None) -> list[Value]:
        node = Node(len(self.nodes), op, inputs, dict(attrs), loc=loc or _user_location())
        outs = []
        for i, t in enumerate(out_types):
            v = Value(self, len(self.values), t, node, i)
            self.values.append(v)
            outs.append(v)
        node.outputs = tuple(outs)
        self.nodes.append(node)
        return outs

    # copying -----------------------------------------------------------------------------------
    def copy(self, name: str | None = None) -> Graph:
        """A deep structural copy keeping node and value ids (``copy[v]`` maps values)."""
        g = Graph(name or self.name)
        for n in self.nodes:
            ins = tuple(g.values[v.id] for v in n.inputs)
            g._add_node(n.op, ins, n.attrs, [v.type for v in n.outputs], loc=n.loc)
        for lname, lf in self.leaves.items():
            g.leaves[lname] = Leaf(
                lf.kind, lf.name, g.values[lf.value.id], lf.init, lf.trainable, lf.data
            )
        g.updates = {k: g.values[v.id] for k, v in self.updates.items()}
        return g

    def __getitem__(self, v: Value) -> Value:
        """The value of this graph with the same id as ``v`` (of the graph this was copied from)."""
        if v.graph is self:
            return v
        mine = self.values[v.id] if v.id < len(self.values) else None
        if mine is None or mine.type != v.type or mine.node.op != v.node.op:
            raise GraphBuildError(f"{v!r} is not a value of graph {self.name!r} or its origin")
        return mine

    # inspection --------------------------------------------------------------------------------
    def __str__(self) -> str:
        lines = [f"graph {self.name} {{"]
        for n in self.nodes:
            outs = ", ".join(f"%{v.id}" for v in n.outputs)
            typ = ", ".join(str(v.type) for v in n.outputs)
            if n.op in _LEAF_KINDS:
                lf = self.leaves[n.attrs["name"]]
                extra = f"  init={lf.init}" if lf.init is not None else ""
                lines.append(f"  {outs} = {n.op} {lf.name!r} : {typ}{extra}    # {n.loc}")
                continue
            args = ", ".join(f"%{v.id}" for v in n.inputs)
            attrs = ", ".join(f"{k}={_fmt_attr(a)}" for k, a in n.attrs.items())
            attrs = f" {{{attrs}}}" if attrs else ""
            lines.append(f"  {outs} = {n.op}({args}){attrs} : {typ}    # {n.loc}")
        for k, v in self.updates.items():
            lines.append(f"  update {k!r} <- %{v.id}")
        lines.append("}")
        return "\n".join(lines)

    __repr__ = __str__

    def fingerprint(self) -> str:
        """Hash of the structure (ops, attrs, types, leaf names): identifies a graph in
        checkpoints."""
        h = hashlib.sha256()
        for n in self.nodes:
            h.update(repr((n.op, [v.id for v in n.inputs], sorted(
                (k, _fmt_attr(a)) for k, a in n.attrs.items()
            ), [str(v.type) for v in n.outputs])).encode())
        return h.hexdigest()[:16]

    def ancestors(self, roots: Iterable[Value]) -> set[int]:
        """Ids of nodes that ``roots`` depend on (inclusive)."""
        seen: set[int] = set()
        stack = [v.node for v in roots]
        while stack:
            n = stack.pop()
            if n.id in seen:
                continue
            seen.add(n.id)
            stack.extend(v.node for v in n.inputs)
        return seen


def _fmt_attr(a) -> str:
    if isinstance(a, DType):
        return a.name
    if isinstance(a, float):
        return repr(a)
    return str(a)


def _as_shape(shape, what: str) -> Shape:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        out = tuple(int(s) for s in shape)
    except TypeError:
        raise ShapeError(f"{what}: shape must be a sequence of ints, got {shape!r}") from None
    if any(s < 0 for s in out) or any(int(s) != s for s in shape):
        raise ShapeError(f"{what}: invalid shape {shape!r}")
    return out


def as_shape(shape, what: str = "shape") -> Shape:
    return _as_shape(shape, what)


def _leaf_infer(kind: str):
    def infer(types, attrs):  # leaves get their type from _add_node directly
        raise GraphBuildError(f"{kind} values are created with Graph.{kind}(), not apply()")

    return infer


for _k in _LEAF_KINDS:
    register_op(OpDef(_k, _leaf_infer(_k), None, leaf=True))
