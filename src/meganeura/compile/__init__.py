"""``compile``: graph (+ loss, optimizer) → a ready Session.

The stages, in order (each a plain function from one structure to the next):
``build_program`` (autodiff, optimizer) → ``compile_program`` (passes → schedule → memory →
kernels) → ``Executable`` → the runtime's ``GPUSession``.  Options are checked here, once.
This module is the only place in ``compile/`` that touches ``runtime/``: it opens the device
(whose limits and features become the kernels' ``Target``) and hands the Executable over."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Mapping

import numpy as np

from ..errors import GraphBuildError
from ..graph import Graph, Value
from ..kernels.common import make_target
from ..kernels.ir import PRECISIONS
from ..program import Program, build_program
from .pipeline import CompileOptions, Tuning, binding_cap, compile_program
from .tune import TuningCache, tune_mode

_GPU_OPTIONS = ("fuse", "plan_memory", "group_params", "device", "share", "tune", "portable")
_REFERENCE_OPTIONS = ("dtype", "share")


def compile(graph: Graph, loss: Value | None = None, outputs: Mapping[str, Value] | None = None,
            optimizer=None, precision: str = "strict", backend: str | None = None,
            check_finite: bool = True, nan_check: str | None = None, **options):
    """Compile ``graph`` into a Session.

    loss/optimizer: training (``step``); outputs: named values returned by ``run``/``step``.
    backend: "wgpu" (default), "dawn", "auto" or "reference" (numpy interpreter; option
    ``dtype=np.float64`` for double precision).  Options for the GPU backend: ``fuse``,
    ``plan_memory``, ``group_params`` (all default True), ``device``, ``tune``, ``portable``.

    portable: True emits kernels for WebGPU's guaranteed limits and no optional features
    (not this device's), untuned, so an exported program (``session.export``) runs on any
    WebGPU device, browsers included (docs/deploy.md).  Default False.

    tune: "cache" (default; ``$MEGANEURA_TUNE``) uses tuned kernel configurations found in
    the on-disk cache (``$MEGANEURA_TUNE_CACHE``, default ``~/.cache/meganeura/tuning.json``)
    and heuristic defaults elsewhere; True times the candidate configurations of every kernel
    without an entry on this device and saves the fastest (slow the first time; ``meganeura
    tune`` does it ahead of time); False uses the heuristics only.  ``session.tuning`` says
    what happened.

    precision: "strict" (default) computes everything in f32.  "fast" lets matmuls round their
    operands to f16 and accumulate in f32 on tensor cores where the device has them (Dawn with
    f16 subgroup matrices, e.g. NVIDIA through Vulkan); on other devices, and for every other
    kernel, it is the same as strict.  ``session.kernel_variants()`` says which kernels ran
    fast.  The reference backend always computes exactly (precision is ignored there).

    nan_check: None (default, no cost) or "step": each training step also reduces the loss and
    every gradient to non-finite flags on the device (read with the loss); a step whose loss
    or some gradient holds NaN/inf applies no update (parameters, optimizer states and
    ``optim.step`` keep their values) and reading its result raises ``NonFiniteError``
    naming the loss or the first parameter whose gradient was bad.

    device: the device to run on: a ``runtime.device.Device`` or a raw wgpu-py ``GPUDevice`` the
    host application opened (a render loop's): the session then submits on the host's queue, in
    order with the host's own work (docs/deploy.md, "Sharing the host's device").

    share: another session of the same backend; persistent tensors (parameters, states) with
    the same name in both live in one buffer, so each session sees the other's updates (e.g. a
    prefill and a decode graph over one KV cache).  Shared tensors keep their current values;
    the others are initialized as usual.
    """
    _check_options(precision, backend, options)  # before any work
    with _gc_paused():
        program = build_program(graph, loss, outputs, optimizer, nan_check)
        return _session(program, precision, backend, check_finite, options)


def compile_built(program: Program, precision: str = "strict", backend: str | None = None,
                  check_finite: bool = True, *, inference: bool = True, **options):
    """A Session for a Program built by the caller instead of by ``build_program``: e.g.
    ``meganeura.distributed``'s optimizer update, whose gradients are fed inputs (no loss to
    differentiate), and its gradient step, whose gradients are fetched results.  Options
    as for ``compile``.  ``inference=False``: the session of a training program only steps,
    so its inference stream (a second plan and emit of the whole graph) is not compiled and
    ``run()`` raises; the GPU backends only (the reference backend compiles nothing)."""
    if not isinstance(program, Program):
        raise GraphBuildError(f"compile_built: expected a Program, got "
                              f"{type(program).__name__}")
    _check_options(precision, backend, options)
    with _gc_paused():
        return _session(program, precision, backend, check_finite, options, inference)


def _session(program: Program, precision: str, backend, check_finite: bool, options: dict,
             inference: bool = True):
    """The Session of a built Program on its backend (options already checked)."""
    if backend == "reference":
        from ..reference import ReferenceSession

        return ReferenceSession(program, dtype=options.get("dtype", np.float32),
                                check_finite=check_finite, share=options.get("share"))
    return _gpu_session(program, precision, backend, check_finite, options, inference)


@contextlib.contextmanager
def _gc_paused():
    """Compiling allocates ~10^5 small objects (nodes, values, kernel descriptions) that all
    live until it ends; Python's cyclic collector rescans them at every generation-2 pass,
    which was about a third of SmolLM2's compile time.  Nothing made during a compile is
    cyclic garbage worth collecting early, so the collector pauses and is restored after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _check_options(precision: str, backend, options: dict) -> None:
    """Every option error at compile time, before any work, naming the option."""
    if precision not in PRECISIONS:
        raise GraphBuildError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    known = _REFERENCE_OPTIONS if backend == "reference" else _GPU_OPTIONS
    unknown = sorted(set(options) - set(known))
    if unknown:
        where = "the reference backend" if backend == "reference" else "the GPU backends"
        raise GraphBuildError(f"compile: unknown option(s) {unknown} for {where}; "
                              f"known: {list(known)}")
    if "dtype" in options:  # an int or f16 interpreter would compute something else silently
        try:
            dt = np.dtype(options["dtype"])
        except TypeError:
            dt = None
        if dt not in (np.float32, np.float64):
            raise GraphBuildError(f"compile: dtype must be np.float32 or np.float64 (the "
                                  f"reference interpreter's precision), got "
                                  f"{options['dtype']!r}")


def _gpu_session(program, precision: str, backend, check_finite: bool, options: dict,
                 inference: bool = True):
    from ..runtime.device import as_device
    from ..runtime.session import GPUSession

    share, device = options.get("share"), options.get("device")
    if device is not None:  # a host application's raw GPUDevice becomes a Device here
        device = as_device(device)
    if share is not None:
        if not isinstance(share, GPUSession):
            raise GraphBuildError(f"share: cannot share tensors between a GPUSession and a "
                                  f"{type(share).__name__}")
        if device is not None and device is not share.dev:
            raise GraphBuildError("share: the sessions must use the same device")
        device = share.dev
        grouped = [n for n in program.persistent if n in share.executable.group_home]
        if grouped:
            raise GraphBuildError(
                f"share: {grouped[:3]} live in a parameter group of the other session; "
                "compile that session with group_params=False to share them")
    device = device or as_device(None, backend)
    portable = bool(options.get("portable", False))
    # portable: the limits every WebGPU device has; tuned configurations may assume more
    tuning = _tuning(device, False if portable else options.get("tune"))
    target = make_target(None) if portable else make_target(device)
    opts = CompileOptions(precision, options.get("fuse", True), options.get("plan_memory", True),
                          options.get("group_params", True),
                          binding_cap(target), inference)
    exe = compile_program(program, target, opts, shares_tensors=share is not None,
                          tuning=tuning)
    sess = GPUSession(program, exe, device, check_finite, share)
    sess.tuning = tuning.report
    return sess


def _tuning(device, option) -> Tuning:
    """The tuning context of one compile: cache and (mode True) a timer on ``device``."""
    from ..runtime.tuning import KernelTimer, device_key

    mode = tune_mode(option)
    if mode is False:
        return Tuning(mode=False)
    return Tuning(mode, device_key(device), TuningCache(),
                  KernelTimer(device) if mode is True else None)
