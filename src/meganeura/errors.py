"""Exception types.  Every user-facing failure is one of these, with a message naming the
problem (op, operands, shapes, tensor names) so it can be fixed without a debugger."""


class MeganeuraError(Exception):
    """Base of all meganeura errors."""


class GraphBuildError(MeganeuraError, ValueError):
    """A graph could not be built as written."""


class ShapeError(GraphBuildError):
    """Operand shapes do not fit the op (matmul inner dims, broadcasting, reshape sizes…)."""


class DTypeError(GraphBuildError, TypeError):
    """Operand dtypes do not fit the op (mixed dtypes, float labels for cross-entropy…)."""


class AxisError(GraphBuildError):
    """An axis argument is out of range or repeated."""


class NameConflictError(GraphBuildError):
    """Two inputs/parameters/states share a name, or a name is empty."""


class AutodiffError(MeganeuraError, ValueError):
    """A gradient request cannot be satisfied (non-scalar loss, non-parameter target…)."""


class FeedError(MeganeuraError, ValueError):
    """Data fed to a session is missing, unknown, mis-shaped, of the wrong dtype or not finite."""


class CheckpointError(MeganeuraError, ValueError):
    """A checkpoint is corrupt, truncated or does not match the graph."""


class DeviceError(MeganeuraError, RuntimeError):
    """No usable GPU adapter, or a device limit would be exceeded."""


class LimitError(DeviceError):
    """A kernel or buffer would exceed a device limit."""


class NonFiniteError(MeganeuraError, FloatingPointError):
    """A training step compiled with ``nan_check="step"`` met a NaN/inf loss or gradient (its
    update was not applied).  ``culprit``: "loss" or the first parameter with a bad gradient;
    ``culprits``: all of them; ``step``: the step number."""

    def __init__(self, msg: str, culprit: str = "", culprits: tuple[str, ...] = (),
                 step: int = 0):
        super().__init__(msg)
        self.culprit, self.culprits, self.step = culprit, culprits, step
