"""``compile``: graph → Program → Session on the chosen backend."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..errors import GraphBuildError
from ..graph import Graph, Value
from ..kernels.ir import PRECISIONS
from ..program import build_program


def compile(graph: Graph, loss: Value | None = None, outputs: Mapping[str, Value] | None = None,
            optimizer=None, precision: str = "strict", backend: str | None = None,
            check_finite: bool = True, **options):
    """Compile ``graph`` into a Session.

    loss/optimizer: training (``step``); outputs: named values returned by ``run``/``step``.
    backend: "wgpu" (default), "dawn", "auto" or "reference" (numpy interpreter; option
    ``dtype=np.float64`` for double precision).  Options for the GPU backend: ``fuse``,
    ``plan_memory`` (both default True), ``device``.

    precision: "strict" (default) computes everything in f32.  "fast" lets matmuls round their
    operands to f16 and accumulate in f32 on tensor cores where the device has them (Dawn with
    f16 subgroup matrices, e.g. NVIDIA through Vulkan); on other devices, and for every other
    kernel, it is the same as strict.  ``session.kernel_variants()`` says which kernels ran
    fast.  The reference backend always computes exactly (precision is ignored there).

    share: another session of the same backend; persistent tensors (parameters, states) with
    the same name in both live in one buffer, so each session sees the other's updates (e.g. a
    prefill and a decode graph over one KV cache).  Shared tensors keep their current values;
    the others are initialized as usual.
    """
    if precision not in PRECISIONS:
        raise GraphBuildError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    program = build_program(graph, loss, outputs, optimizer)
    if backend == "reference":
        from ..reference import ReferenceSession

        return ReferenceSession(program, dtype=options.pop("dtype", np.float32),
                                check_finite=check_finite, share=options.pop("share", None))
    from ..runtime.session import GPUSession

    return GPUSession(program, precision=precision, backend=backend, check_finite=check_finite,
                      **options)
