"""meganeura: compile a typed static neural-network graph into one GPU program (WebGPU)."""

from . import init, nn, ops, optim  # noqa: F401
from .autodiff import grad  # noqa: F401
from .compile import compile  # noqa: F401
from .dtypes import bool_, f16, f32, i32, u32  # noqa: F401
from .errors import (  # noqa: F401
    AutodiffError,
    AxisError,
    CheckpointError,
    DeviceError,
    DTypeError,
    FeedError,
    GraphBuildError,
    LimitError,
    MeganeuraError,
    NameConflictError,
    NonFiniteError,
    ShapeError,
)
from .graph import Graph, TensorType, Value  # noqa: F401
from .runtime.artifact import load_program  # noqa: F401

__version__ = "0.1.0"


def from_torch(module, example_inputs, **kwargs):
    """Import a ``torch.nn.Module`` through ``torch.export`` (needs the ``[torch]`` extra;
    torch is imported only here).  See ``meganeura.io.torch_import.from_torch``."""
    from .io.torch_import import from_torch as _from_torch

    return _from_torch(module, example_inputs, **kwargs)
