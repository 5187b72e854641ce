"""Tensor element types of the graph.

Types are strict: binary ops need equal dtypes (use ``.cast``); Python scalars adopt the dtype of
the tensor they meet.  ``bool`` is stored as ``u32`` on the GPU because WGSL bools are not
host-shareable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import DTypeError


@dataclass(frozen=True)
class DType:
    name: str
    numpy: str
    is_float: bool
    is_int: bool
    gpu_itemsize: int
    wgsl: str

    @property
    def np(self) -> np.dtype:
        return np.dtype(self.numpy)

    def __repr__(self) -> str:
        return self.name


f32 = DType("f32", "float32", True, False, 4, "f32")
f16 = DType("f16", "float16", True, False, 2, "f16")
i32 = DType("i32", "int32", False, True, 4, "i32")
u32 = DType("u32", "uint32", False, True, 4, "u32")
bool_ = DType("bool", "bool", False, False, 4, "u32")

ALL = (f32, f16, i32, u32, bool_)
_BY_NAME = {d.name: d for d in ALL}
_BY_NAME.update({"float32": f32, "float16": f16, "int32": i32, "uint32": u32, "bool_": bool_})


def as_dtype(x: object) -> DType:
    """Accept a DType, its name, or a numpy dtype (float64 maps to f32: the graph's float type)."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str) and x in _BY_NAME:
        return _BY_NAME[x]
    try:
        nd = np.dtype(x)  # type: ignore[arg-type]
    except TypeError:
        nd = None
    if nd is not None:
        if nd == np.float64:
            return f32
        if nd == np.int64:
            return i32
        for d in ALL:
            if d.np == nd:
                return d
    raise DTypeError(f"unknown dtype {x!r}; expected one of {[d.name for d in ALL]}")
