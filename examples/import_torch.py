"""Bring a PyTorch model: import a ``torch.nn`` CNN with ``mn.from_torch``, train it with our
optimizer on the GPU (scikit-learn's digits), check it against PyTorch, save a checkpoint.

  python examples/import_torch.py [--epochs 3]

Prints one line per epoch and ends with ``first_loss=… last_loss=… accuracy=… max_diff=…``
(``max_diff``: largest difference between our logits and PyTorch's on the trained weights)."""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import meganeura as mn
from meganeura.io.datasets import batches, load_digits


class DigitsNet(nn.Module):
    """An ordinary PyTorch model: nothing in it knows about meganeura."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 2 * 2, 10)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        h = F.max_pool2d(F.gelu(self.conv2(h)), 2)
        return self.fc(h.flatten(1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    model = DigitsNet().train()  # training mode: batch norm uses (and updates) batch statistics
    x, y = load_digits("train")
    x = x.reshape(-1, 1, 8, 8)

    # 1. import: one static graph for this batch shape, with the loss exported alongside
    example = (torch.zeros(args.batch, 1, 8, 8),)
    imp = mn.from_torch(model, example, loss=F.cross_entropy,
                        loss_inputs=(torch.zeros(args.batch, dtype=torch.long),))
    print(f"imported {len(imp.graph.nodes)} nodes, inputs {list(imp.inputs)}, "
          f"{len(imp.params)} parameters, states {sorted(imp.states)}")

    # 2. train with our autodiff and optimizer (weights start as the module's)
    sess = imp.compile(mn.optim.AdamW(lr=3e-3))
    losses = []
    for epoch in range(args.epochs):
        for xb, yb in batches(x, y, args.batch, seed=epoch, drop_last=True):
            losses.append(float(sess.step(x=xb, target=yb).loss))
        print(f"epoch {epoch}: loss {np.mean(losses[-10:]):.4f}")

    # 3. inference graph: the module in eval mode (running statistics), our trained weights
    model.eval()
    xt, yt = load_digits("test")
    xt = xt.reshape(-1, 1, 8, 8)
    test = mn.from_torch(model, torch.zeros(len(xt), 1, 8, 8))
    infer = mn.compile(test.graph, outputs=test.outputs)
    trained = sess.get_state()
    infer.set_params({k: trained[k] for k in test.weights})
    logits = infer.run(x=xt)["output"]
    accuracy = float((logits.argmax(1) == yt).mean())

    # 4. the same weights back in PyTorch give the same logits; a checkpoint needs no torch
    model.load_state_dict({k: torch.from_numpy(np.asarray(trained[k]))
                           for k in model.state_dict() if k in trained}, strict=False)
    with torch.no_grad():
        max_diff = float(np.abs(model(torch.from_numpy(xt)).numpy() - logits).max())
    with tempfile.TemporaryDirectory() as d:
        infer.save(os.path.join(d, "digits.safetensors"))
    print(f"first_loss={losses[0]:.4f} last_loss={np.mean(losses[-5:]):.4f} "
          f"accuracy={accuracy:.3f} max_diff={max_diff:.2e}")


if __name__ == "__main__":
    main()
