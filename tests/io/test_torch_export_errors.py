"""``mn.from_torch`` refuses what it cannot import, all at once and before building."""

import pytest
import torch
from torch import nn

import meganeura as mn
from meganeura.io.torch_import import UnsupportedOpsError


class _Unsupported(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(2, 2, 2, stride=2)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        a = torch.cumsum(x, 1)  # cumsum of a runtime value
        b = torch.cumsum(x * 2, 2)
        c = torch.sort(x, -1).values
        return self.drop(self.up(a + b + c))


def test_every_unsupported_op_is_reported_with_counts_and_lines():
    with pytest.raises(UnsupportedOpsError) as err:
        mn.from_torch(_Unsupported().train(), torch.randn(1, 2, 4, 4))
    e = err.value
    assert set(e.ops) == {"aten.cumsum.default", "aten.sort.default",
                          "aten.convolution.default (transposed convolution)",
                          "aten.native_dropout.default (training mode with p > 0 (call "
                          "module.eval() or set p=0))"}
    assert len(e.ops["aten.cumsum.default"]) == 2
    msg = str(e)
    assert "4 unsupported op kind(s), 5 use(s)" in msg and "nothing was built" in msg
    assert "aten.cumsum.default  ×2" in msg
    assert "test_torch_export_errors.py:18 in forward: a = torch.cumsum(x, 1)" in msg
    assert "test_torch_export_errors.py:19 in forward: b = torch.cumsum(x * 2, 2)" in msg


def test_ops_on_constants_are_computed_at_import():
    """cumsum/sort over constants (no converter needed): evaluated by PyTorch at import."""

    class M(nn.Module):
        def forward(self, x):
            return x + torch.sort(torch.cumsum(torch.arange(4.0), 0), descending=True).values

    imp = mn.from_torch(M(), torch.zeros(4))
    out = imp.compile(backend="reference").run(x=torch.ones(4).numpy())["output"]
    assert out.tolist() == [7.0, 4.0, 2.0, 1.0]


@pytest.mark.parametrize("bad,match", [
    (dict(dynamic=True), "static shapes"),
    (dict(loss_inputs=(torch.zeros(1),)), "without a loss"),
])
def test_bad_arguments(bad, match):
    with pytest.raises(mn.GraphBuildError, match=match):
        mn.from_torch(nn.Linear(2, 2), torch.zeros(1, 2), **bad)


def test_not_a_module_and_float64():
    with pytest.raises(mn.GraphBuildError, match="expected a torch.nn.Module"):
        mn.from_torch(lambda x: x, torch.zeros(1))
    with pytest.raises(UnsupportedOpsError, match=r"torch.float64"):
        mn.from_torch(nn.Linear(2, 2).double(), torch.zeros(1, 2, dtype=torch.float64))


def test_export_failure_is_wrapped():
    class DataDependent(nn.Module):
        def forward(self, x):
            return x[x > 0]  # shape depends on the data

    with pytest.raises(mn.GraphBuildError, match="torch.export|unsupported"):
        mn.from_torch(DataDependent(), torch.randn(4))


def test_core_imports_without_torch():
    """torch is imported only when from_torch is called (the [torch] extra is optional)."""
    import subprocess
    import sys

    code = "import sys, meganeura; assert 'torch' not in sys.modules; print(meganeura.from_torch)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
