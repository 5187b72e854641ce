"""PyTorch twins (plain torch.nn) of the vision models — ResNet (torchvision's layout) and the
SD-style U-Net — with weight copying both ways and the gates of DESIGN.md §5.  Module paths
equal our parameter names, so ``state_dict()`` keys (minus ``num_batches_tracked``) are ours.
Test-only: torch is not a dependency of meganeura."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import meganeura as mn

FWD_TOL = 1e-4  # strict: relative L2 of outputs / loss
BWD_TOL = 1e-3  # strict: relative L2 of every parameter gradient
SKIP = ("num_batches_tracked",)


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _skip(k: str) -> bool:
    return k.endswith(SKIP)


def to_numpy(module: nn.Module) -> dict[str, np.ndarray]:
    """Twin parameters and buffers (running stats) as float32 numpy, by name (torch → ours)."""
    return {k: v.detach().cpu().numpy().astype(np.float32)
            for k, v in module.state_dict().items() if not _skip(k)}


def load_into(module: nn.Module, params: dict[str, np.ndarray]) -> None:
    """Copy our parameters/states into the twin (ours → torch); every entry must be given."""
    sd = module.state_dict()
    missing = [k for k in sd if k not in params and not _skip(k)]
    assert not missing, f"missing {missing}"
    extra = [k for k in params if k not in sd]
    assert not extra, f"not in the twin: {extra}"
    with torch.no_grad():
        for k, t in sd.items():
            if k in params:
                t.copy_(torch.from_numpy(np.asarray(params[k])).to(t.dtype))


def grads_of(module: nn.Module) -> dict[str, np.ndarray]:
    return {k: p.grad.detach().cpu().numpy() for k, p in module.named_parameters()}


def grad_session(graph, loss, outputs, **kw):
    """Session computing ``outputs``, the loss, every parameter gradient (``grad:<name>``) and
    the graph's state updates (``update:<name>``, running statistics) in one run."""
    g2, grads = mn.grad(graph, loss)
    outs = {k: g2[v] for k, v in outputs.items()}
    outs["loss"] = g2[loss]
    outs.update({f"grad:{k}": v for k, v in grads.items()})
    outs.update({f"update:{k}": v for k, v in g2.updates.items()})
    return mn.compile(g2, outputs=outs, **kw)


def check_gates(ours: dict, fwd: dict, grads: dict, fwd_tol=FWD_TOL, bwd_tol=BWD_TOL):
    """Forward gate on every ``fwd`` entry, backward gate on every gradient; returns the worst
    errors (forward, backward) for the record."""
    worst_f = max(rel_l2(ours[k], ref) for k, ref in fwd.items())
    bad = {k: rel_l2(ours[k], ref) for k, ref in fwd.items() if rel_l2(ours[k], ref) > fwd_tol}
    assert not bad, f"forward gate {fwd_tol}: {bad}"
    errs = {k: rel_l2(ours[f"grad:{k}"], g) for k, g in grads.items()}
    bad = {k: e for k, e in errs.items() if e > bwd_tol}
    assert not bad, f"backward gate {bwd_tol}: {bad}"
    return worst_f, max(errs.values())


# ------------------------------------------------------------------------------ ResNet


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin, planes, stride, eps, momentum):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes, eps, momentum)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes, eps, momentum)
        self.downsample = None
        if stride != 1 or cin != planes:
            self.downsample = nn.Sequential(nn.Conv2d(cin, planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes, eps, momentum))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin, planes, stride, eps, momentum):
        super().__init__()
        cout = planes * 4
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes, eps, momentum)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes, eps, momentum)
        self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout, eps, momentum)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout, eps, momentum))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        return F.relu(h + (x if self.downsample is None else self.downsample(x)))


class TorchResNet(nn.Module):
    """torchvision's ResNet (v1.5) for a ``meganeura.models.resnet.ResNetConfig``."""

    def __init__(self, cfg):
        super().__init__()
        eps, mom = cfg.bn_eps, cfg.bn_momentum
        block = Bottleneck if cfg.block == "bottleneck" else BasicBlock
        self.conv1 = nn.Conv2d(cfg.in_channels, cfg.width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(cfg.width, eps, mom)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = cfg.width
        for i, n in enumerate(cfg.layers):
            planes = cfg.width * 2**i
            blocks = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(block(cin, planes, stride, eps, mom))
                cin = planes * block.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.n_layers = len(cfg.layers)
        self.fc = nn.Linear(cin, cfg.num_classes)

    def forward(self, x):
        h = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        for i in range(self.n_layers):
            h = getattr(self, f"layer{i + 1}")(h)
        return self.fc(h.mean((2, 3)))


# ------------------------------------------------------------------------------ U-Net


class ResnetBlock(nn.Module):
    def __init__(self, cin, cout, groups, eps):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin, eps)
        self.conv1 = nn.Conv2d(cin, cout, 3, 1, 1)
        self.norm2 = nn.GroupNorm(groups, cout, eps)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return h + (x if self.conv_shortcut is None else self.conv_shortcut(x))


class _Sampler(nn.Module):
    def __init__(self, ch, stride):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, stride, 1)


class _Level(nn.Module):
    def __init__(self, resnets, sampler=None, key="downsamplers"):
        super().__init__()
        self.resnets = nn.ModuleList(resnets)
        if sampler is not None:
            setattr(self, key, nn.ModuleList([sampler]))


class TorchUNet(nn.Module):
    """The twin of ``meganeura.models.unet`` (diffusers-style names)."""

    def __init__(self, cfg):
        super().__init__()
        G, eps = cfg.groups, cfg.eps
        chans = [cfg.base * m for m in cfg.mults]
        self.cfg = cfg
        self.conv_in = nn.Conv2d(cfg.in_channels, chans[0], 3, 1, 1)
        down, cin, skips = [], chans[0], []
        for lvl, ch in enumerate(chans):
            res = []
            for _ in range(cfg.num_res_blocks):
                res.append(ResnetBlock(cin, ch, G, eps))
                cin = ch
            skips.append(ch)
            last = lvl == len(chans) - 1
            down.append(_Level(res, None if last else _Sampler(ch, 2), "downsamplers"))
        self.down_blocks = nn.ModuleList(down)
        self.mid_block = _Level([ResnetBlock(cin, cin, G, eps)])
        up = []
        for lvl in reversed(range(len(chans))):
            ch = chans[lvl]
            res = []
            for r in range(cfg.num_res_blocks):
                res.append(ResnetBlock(cin + (skips[lvl] if r == 0 else 0), ch, G, eps))
                cin = ch
            up.append(_Level(res, _Sampler(ch, 1) if lvl > 0 else None, "upsamplers"))
        self.up_blocks = nn.ModuleList(up)
        self.conv_norm_out = nn.GroupNorm(G, cin, eps)
        self.conv_out = nn.Conv2d(cin, cfg.out_channels, 3, 1, 1)

    def forward(self, x):
        h = self.conv_in(x)
        skips = []
        for blk in self.down_blocks:
            for r in blk.resnets:
                h = r(h)
            skips.append(h)
            if hasattr(blk, "downsamplers"):
                h = blk.downsamplers[0].conv(h)
        h = self.mid_block.resnets[0](h)
        for blk in self.up_blocks:
            h = torch.cat([h, skips.pop()], 1)
            for r in blk.resnets:
                h = r(h)
            if hasattr(blk, "upsamplers"):
                h = F.interpolate(h, scale_factor=2, mode="nearest")
                h = blk.upsamplers[0].conv(h)
        return self.conv_out(F.silu(self.conv_norm_out(h)))
