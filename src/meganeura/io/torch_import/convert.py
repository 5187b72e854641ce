"""The ATen → meganeura op table: one converter per core ATen op (after
``run_decompositions``), each building the op from ``meganeura.ops`` builders.

A converter is ``fn(cx, *args, **kwargs)``: the node's arguments with every fx node replaced
by what it became (a ``Value``, a tuple of them, or a ``torch.Tensor`` for a value computed at
import time from constants only), Python scalars and lists as PyTorch passed them.  ``cx``
(:class:`Ctx`) turns tensors into graph values and knows the node's output type.  An optional
``check(node) -> str | None`` names a feature of one node the converter cannot handle (a
transposed convolution, dropout in training mode): such nodes are reported with the unknown
ops before anything is built.

The converters live in three modules by family (``convert_pointwise``, ``convert_shape``,
``convert_nn``); this one holds the registry and the helpers they share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ... import ops
from ...dtypes import DType, bool_, f16, f32, i32
from ...errors import DTypeError
from ...graph import Graph, Value

_DTYPES = {torch.float32: f32, torch.float16: f16, torch.int64: i32, torch.int32: i32,
           torch.bool: bool_}


@dataclass(frozen=True)
class Converter:
    fn: Callable
    check: Callable | None = None


CONVERTERS: dict[str, Converter] = {}


def aten(*names: str, check: Callable | None = None):
    """Register the decorated function as the converter of ``aten.<name>`` for each name."""

    def deco(fn):
        for n in names:
            if f"aten.{n}" in CONVERTERS:
                raise RuntimeError(f"converter for aten.{n} registered twice")
            CONVERTERS[f"aten.{n}"] = Converter(fn, check)
        return fn

    return deco


def mn_dtype(dt: torch.dtype, what: str = "tensor") -> DType:
    """Our dtype for a torch dtype: int64 indices become i32 (the GPU's integer); float64 and
    the rest have no GPU equivalent and are refused (convert the module with ``.float()``)."""
    try:
        return _DTYPES[dt]
    except KeyError:
        raise DTypeError(f"{what}: torch dtype {dt} is not supported (float32, float16, "
                         "int64/int32 and bool are; call module.float() first)") from None


def op_name(node) -> str:
    """``aten.add.Tensor`` for an fx node's target (``operator.getitem`` for Python ones)."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return str(t)
    return f"{getattr(t, '__module__', '?')}.{getattr(t, '__name__', t)}"


@dataclass
class Ctx:
    """What a converter needs besides its arguments: the graph, the current node's output
    type (from the export's metadata), and constants made once per tensor."""

    graph: Graph
    node: object = None
    _consts: dict[int, tuple[Value, torch.Tensor]] = field(default_factory=dict)

    @property
    def val(self):
        """The node's example output (a FakeTensor, or a tuple of them) from the export."""
        return self.node.meta.get("val")

    @property
    def out_dtype(self) -> DType:
        v = self.val
        return mn_dtype((v[0] if isinstance(v, (tuple, list)) else v).dtype, str(self.node))

    @property
    def out_shape(self) -> tuple[int, ...]:
        v = self.val
        return tuple(int(d) for d in (v[0] if isinstance(v, (tuple, list)) else v).shape)

    def v(self, x, dtype: DType | None = None) -> Value:
        """A graph value for a tensor argument (a Value, or a constant tensor or scalar),
        cast to ``dtype`` when given."""
        if isinstance(x, Value):
            out = x
        elif isinstance(x, torch.Tensor):
            out = self._const(x)
        else:
            dt = dtype or (bool_ if isinstance(x, bool) else f32 if isinstance(x, float) else i32)
            out = self.graph.scalar(x, dt)
        return out if dtype is None else ops.cast(out, dtype)

    def _const(self, t: torch.Tensor) -> Value:
        """A constant: a ``full`` (no buffer) when every element is the same, else stored."""
        key = id(t)
        if key not in self._consts:
            dt = mn_dtype(t.dtype, f"constant of {self.node}")
            arr = t.detach().cpu().numpy()
            if arr.size and (arr == arr.flat[0]).all():
                out = self.graph.full(arr.shape, arr.flat[0].item(), dt)
            else:
                out = self.graph.const(arr.astype(dt.np))
            self._consts[key] = (out, t)  # keep t alive: its id stays unique
        return self._consts[key][0]

    def pair(self, a, b, dtype: DType | None = None) -> tuple[Value, Value]:
        """Both operands as values of one dtype (``dtype``, or the node's result dtype): ATen
        promotes types implicitly, our ops need them equal."""
        dt = dtype or self.out_dtype
        return self.v(a, dt), self.v(b, dt)


def promoted(*xs) -> DType:
    """The dtype ATen computes a comparison in: float if any operand is float, else int, else
    bool (Python scalars count as their kind)."""
    kinds = []
    for x in xs:
        if isinstance(x, Value):
            kinds.append(x.dtype)
        elif isinstance(x, torch.Tensor):
            kinds.append(mn_dtype(x.dtype))
        elif isinstance(x, bool):
            kinds.append(bool_)
        else:
            kinds.append(f32 if isinstance(x, float) else i32)
    for dt in (f32, f16, i32):
        if dt in kinds:
            return dt
    return bool_


def static_array(x) -> np.ndarray | None:
    """The value of an argument known at import time (a constant tensor), else None."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return None
