"""Sibling reductions in one dispatch (``MultiReduceKernel``): several reductions of one
iteration shape over the same axes, each with its own prologue, epilogue and output.

Why: a norm's statistics and gradients reduce the same tensors over the same axes several
times (batch norm's backward: ``sum(dy)``, ``sum(dy * x̂)``, …).  Each is a small,
latency-bound dispatch on a big GPU (ResNet-50's 8–12 µs ``reduce_sum`` kernels move under a
megabyte); one dispatch for all of them pays the launch and the index arithmetic once and
loads each shared input once.

The generator is the one of ``kernels/reduce.py`` (a ``ReduceKernel`` is its one-member
case): ``TX`` outputs per workgroup, ``TY`` invocations per output, each folding a
strided share of the reduced range with ``UNROLL`` independent accumulators, then a fixed
tree in workgroup memory.  The order of the arithmetic of each member is the one its own
``ReduceKernel`` would use with the same layout: results are deterministic (no atomics).
"""

from __future__ import annotations

from .archetypes import kernel_family
from .common import make_target
from .ir import KernelSpec, MultiReduceKernel
from .reduce import _Reduce


@kernel_family("multi_reduce", MultiReduceKernel)
def emit(k: MultiReduceKernel, limits=None, features=None, alias=None) -> KernelSpec:
    return _Reduce(k, make_target(limits, features), alias).spec()
