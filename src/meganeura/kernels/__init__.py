"""WGSL code generation: one emitter per kernel archetype (``ir.py`` describes them).

``emit(desc, limits, features)`` turns a kernel description into a ``KernelSpec`` (WGSL source,
binding count, workgroup grid).  ``limits`` is the device's limits dict (or a ``Device``, whose
limits and features are then used; None means WebGPU's guaranteed minimums); ``features`` the
device's feature names (``shader-f16`` enables f16 kernels).  Emitters never touch a device.
"""

from __future__ import annotations

from .common import DEFAULT_LIMITS, CodegenError, Target, make_target
from .ir import (
    Instr,
    KernelSpec,
    MatmulKernel,
    OneHotKernel,
    PointwiseKernel,
    ReduceKernel,
    Strided,
)

__all__ = [
    "DEFAULT_LIMITS",
    "CodegenError",
    "Instr",
    "KernelSpec",
    "MatmulKernel",
    "OneHotKernel",
    "PointwiseKernel",
    "ReduceKernel",
    "Strided",
    "Target",
    "emit",
    "make_target",
]


def emit(desc, limits=None, features=None) -> KernelSpec:
    """The ``KernelSpec`` of one kernel description (dispatch on its type)."""
    import importlib

    modules = {
        PointwiseKernel: "pointwise",
        ReduceKernel: "reduce",
        MatmulKernel: "matmul",
        OneHotKernel: "one_hot",
    }
    mod = modules.get(type(desc))
    if mod is None:
        raise CodegenError(
            f"no WGSL emitter for {type(desc).__name__}; known: "
            f"{', '.join(t.__name__ for t in modules)}"
        )
    return importlib.import_module(f"{__name__}.{mod}").emit(desc, limits, features)
