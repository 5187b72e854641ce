"""Training an imported model with our autodiff and optimizer (issue 17): a ResNet-18
(torchvision's layout, channel widths reduced for CI) on scikit-learn's digits upscaled to
32×32, on the GPU path (lavapipe in CI).  After 3 SGD steps every parameter and running
statistic equals PyTorch's after the same 3 steps (relative L2 ≤ 1e-4); more steps lower the
loss."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import meganeura as mn
from meganeura.io.datasets import load_digits
from meganeura.models.resnet import ResNetConfig

from ..models.test_resnet import _randomize_bn
from ..models.twins_vision import TorchResNet
from .torch_check import rel_l2

BATCH, SIZE, LR = 16, 32, 0.01


def _digits_batches(n: int):
    """``n`` batches of digits as (B, 3, 32, 32) images (8×8 upscaled 4× nearest, grey in
    all three channels, plus a little fixed noise) with their labels.  Without the noise the
    blank background gives exactly equal values in max-pool windows, and which of them is the
    argmax (where the gradient goes) then depends on the last bit of each framework's
    rounding."""
    x, y = load_digits("train")
    img = np.kron(x.reshape(-1, 1, 8, 8), np.ones((1, 3, SIZE // 8, SIZE // 8), np.float32))
    img += 0.05 * np.random.default_rng(0).standard_normal(img.shape, np.float32)
    return [(img[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]) for i in range(n)]


@pytest.mark.gpu
def test_imported_resnet18_trains_like_pytorch(gpu):
    cfg = ResNetConfig(block="basic", layers=(2, 2, 2, 2), width=8, num_classes=10)
    torch.manual_seed(0)
    module = TorchResNet(cfg).train()
    # non-zero batch-norm affine parameters: a zero-initialized bias would be compared by its
    # 3-step change alone, a sum of near-cancelling terms that float32 rounding dominates (PyTorch
    # f32 and f64 differ by 1-20 % there)
    _randomize_bn(module, 1)
    batches = _digits_batches(40)
    x0, y0 = (torch.tensor(a) for a in batches[0])
    imp = mn.from_torch(module, x0, loss=F.cross_entropy, loss_inputs=(y0.long(),))
    sess = imp.compile(mn.optim.SGD(lr=LR), backend="wgpu", device=gpu)

    opt = torch.optim.SGD(module.parameters(), lr=LR)
    losses = []
    for xb, yb in batches[:3]:
        losses.append(float(sess.step(x=xb, target=yb).loss))
        opt.zero_grad()
        F.cross_entropy(module(torch.tensor(xb)), torch.tensor(yb).long()).backward()
        opt.step()
    ours = sess.get_state()
    theirs = {k: v.detach().numpy() for k, v in module.state_dict().items()}
    errs = {k: rel_l2(ours[k], v) for k, v in theirs.items() if k in ours}
    assert set(theirs) == set(errs)
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-4, (worst, errs[worst])

    for xb, yb in batches[3:]:
        losses.append(float(sess.step(x=xb, target=yb).loss))
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:3]), losses


@pytest.mark.gpu
def test_example_imports_trains_and_matches_pytorch():
    """examples/import_torch.py end to end (lavapipe in CI): the loss falls, the test accuracy
    is a trained model's, and PyTorch computes the same logits with the trained weights."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "examples" / "import_torch.py"),
                           "--epochs", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"first_loss=([\d.]+) last_loss=([\d.]+) accuracy=([\d.]+) "
                  r"max_diff=([\d.e+-]+)", proc.stdout)
    assert m, proc.stdout
    first, last, acc, diff = (float(v) for v in m.groups())
    assert last < 0.5 * first and acc > 0.75 and diff < 1e-4
