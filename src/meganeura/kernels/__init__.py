"""WGSL code generation: one emitter per kernel family (``ir.py`` and the family modules
describe them).

``emit(desc, limits, features, alias)`` turns a kernel description into a ``KernelSpec`` (WGSL
source, binding count, workgroup grid).  ``limits`` is the device's limits dict (or a
``Device``, whose limits and features are then used; None means WebGPU's guaranteed minimums);
``features`` the device's feature names (``shader-f16`` enables f16 kernels); ``alias`` says
which binding slots share one buffer range (``binding_aliases(binds)``; those are declared
once).  Emitters never touch a device.

Adding a kernel family: one module here with
  * a frozen dataclass describing one dispatch (its own type: the registry maps types to
    families),
  * ``emit(desc, limits=None, features=None, alias=None) -> KernelSpec``, declaring its
    storage bindings with ``common.Bindings(dtypes, alias)`` (slot names from ``.name(i)``,
    declarations from ``.decls()``, ``n_bindings=.n``),
  * one registration, ``@kernel_family(name, DescType, make=…)`` on ``emit`` (or
    ``archetypes.register(…)``), where ``make(attrs, inputs, outputs)`` builds the description
    from a graph node an op lowers with ``lowering.Kernel(name)``; optional hooks:
    ``contiguous_inputs``, ``epilogue``, ``in_place`` (see ``archetypes.Archetype``);
and the module's name in the import list below (importing it registers the family).
"""

from __future__ import annotations

from . import (  # noqa: F401  (importing a family module registers it)
    attention,
    attention_combine,
    concat,
    conv,
    gather,
    matmul,
    multi_reduce,
    one_hot,
    pointwise,
    pool,
    reduce,
)
from .archetypes import (
    archetype,
    archetype_of,
    candidates,
    emit,
    families,
    kernel_family,
    register,
)
from .common import DEFAULT_LIMITS, Bindings, CodegenError, Target, binding_aliases, make_target
from .ir import (
    Instr,
    KernelSpec,
    MatmulKernel,
    MultiReduceKernel,
    OneHotKernel,
    PointwiseKernel,
    ReduceKernel,
    ReduceMember,
    Strided,
)

__all__ = [
    "DEFAULT_LIMITS",
    "Bindings",
    "CodegenError",
    "Instr",
    "KernelSpec",
    "MatmulKernel",
    "MultiReduceKernel",
    "OneHotKernel",
    "PointwiseKernel",
    "ReduceKernel",
    "ReduceMember",
    "Strided",
    "Target",
    "archetype",
    "archetype_of",
    "binding_aliases",
    "candidates",
    "emit",
    "families",
    "kernel_family",
    "make_target",
    "register",
]
