"""Bring a PyTorch model: ``mn.from_torch(module, example_inputs)`` → a meganeura graph.

The module goes through ``torch.export`` and the core ATen decompositions; each ATen op
becomes our ops (``convert*.py``), parameters keep their state-dict names (numpy copies in
``TorchModel.params``), persistent buffers (batch-norm running statistics) become states.
The imported graph is an ordinary meganeura graph: our autodiff differentiates it, our
optimizers train it, checkpoints and exported artifacts need no torch.  Torch is needed only
here, to import (the ``[torch]`` extra).  See docs/torch-import.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ...errors import GraphBuildError
from ...graph import Graph, Value
from .importer import UnsupportedOpsError, build_graph, export_program, static_nodes, unsupported

__all__ = ["from_torch", "TorchModel", "UnsupportedOpsError"]


@dataclass
class TorchModel:
    """An imported module: the graph, its named inputs and outputs, the loss (when a ``loss``
    was given), and the module's parameters and buffers as numpy arrays by state-dict name."""

    graph: Graph
    inputs: dict[str, Value]
    outputs: dict[str, Value]
    loss: Value | None = None
    params: dict[str, np.ndarray] = field(default_factory=dict)
    states: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def weights(self) -> dict[str, np.ndarray]:
        """Parameters and states together: what ``Session.set_params`` takes."""
        return {**self.params, **self.states}

    def compile(self, optimizer=None, outputs: Mapping[str, Value] | None = None, **options):
        """``mn.compile`` of the graph (with the loss when there is one and an optimizer is
        given), the module's weights already loaded."""
        from ...compile import compile as mn_compile

        outs = dict(self.outputs if outputs is None else outputs)
        loss = self.loss if optimizer is not None else None
        if optimizer is not None and loss is None:
            raise GraphBuildError("TorchModel.compile: training needs a loss; pass loss= to "
                                  "from_torch")
        sess = mn_compile(self.graph, loss=loss, outputs=outs, optimizer=optimizer, **options)
        sess.set_params(self.weights)
        return sess


def _as_tuple(x) -> tuple:
    if isinstance(x, (tuple, list)):
        return tuple(x)
    return (x,)


def _input_names(module, n: int, n_loss: int) -> list[str]:
    """The forward's parameter names for the model inputs (``input0``… when it takes
    ``*args``), then ``target`` (or ``target0``…) for the loss's extra inputs."""
    try:
        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:n]]
    if len(names) < n:
        names = [f"input{i}" for i in range(n)]
    names += ["target"] if n_loss == 1 else [f"target{i}" for i in range(n_loss)]
    return names


def from_torch(module, example_inputs, *, loss=None, loss_inputs: Sequence = (),
               dynamic: bool = False, name: str | None = None) -> TorchModel:
    """Import a ``torch.nn.Module`` through ``torch.export`` as a meganeura graph.

    example_inputs: a tensor or a tuple of tensors (positional arguments of ``forward``); the
        graph is static, built for exactly these shapes and dtypes (int64 becomes i32).
    loss: optional ``loss(output, *loss_inputs)`` (a function or a module) exported with the
        model; ``loss_inputs`` are its example extra arguments (targets), which become graph
        inputs named ``target`` (``target0``… when several).  ``TorchModel.loss`` is then the
        loss value, for ``mn.grad`` or ``compile(optimizer=…)``.
    dynamic: must be False: a meganeura graph has static shapes (export once per shape).

    The module's mode is respected: in training mode batch norm uses batch statistics and
    updates its running statistics after each step; export in eval mode for inference.
    Every unsupported op is reported at once (``UnsupportedOpsError``: names, counts and
    source lines) before anything is built."""
    import torch

    if dynamic:
        raise GraphBuildError("from_torch: dynamic=True is not supported: meganeura graphs have "
                              "static shapes; import once per input shape")
    if not isinstance(module, torch.nn.Module):
        raise GraphBuildError(f"from_torch: expected a torch.nn.Module, got "
                              f"{type(module).__name__}")
    args, extra = _as_tuple(example_inputs), _as_tuple(loss_inputs)
    if extra and loss is None:
        raise GraphBuildError("from_torch: loss_inputs given without a loss")
    bad = [i for i, a in enumerate(args + extra) if not isinstance(a, torch.Tensor)]
    if bad:
        raise GraphBuildError(f"from_torch: example inputs must be tensors; argument(s) {bad} "
                              "are not")
    ep = export_program(module, args + extra, loss, len(args))
    missing = unsupported(ep, static_nodes(ep))
    if missing:
        raise UnsupportedOpsError(missing)
    names = _input_names(module, len(args), len(extra) if loss is not None else 0)
    b = build_graph(ep, names, loss is not None, name or type(module).__name__)
    return TorchModel(b.graph, b.inputs, b.outputs, b.loss, b.params, b.states)
