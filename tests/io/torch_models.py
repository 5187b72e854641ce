"""PyTorch models the importer is tested on, in plain ``torch.nn``.

torchvision cannot be installed beside the CPU build of torch 2.13 here (PyPI's torchvision
wheels are CUDA builds: ``torchvision::nms does not exist`` at import), so ``mobilenet_v3_small``
below follows torchvision's architecture and module names (``features.N.block.M…``) layer by
layer; ResNet-18 is ``tests/models/twins_vision.TorchResNet`` (torchvision's layout)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _divisible(v: float, d: int = 8) -> int:
    new = max(d, int(v + d / 2) // d * d)
    return new + d if new < 0.9 * v else new


class ConvBNAct(nn.Sequential):
    def __init__(self, cin, cout, k, stride=1, groups=1, act=nn.Hardswish):
        layers = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(cout, eps=0.001, momentum=0.01)]
        if act is not None:
            layers.append(act())
        super().__init__(*layers)


class SqueezeExcitation(nn.Module):
    def __init__(self, ch, squeeze):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(ch, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, ch, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Hardsigmoid()

    def forward(self, x):
        s = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return s * x


class InvertedResidual(nn.Module):
    def __init__(self, cin, k, exp, cout, se, act, stride):
        super().__init__()
        act = nn.Hardswish if act == "HS" else nn.ReLU
        layers = []
        if exp != cin:
            layers.append(ConvBNAct(cin, exp, 1, act=act))
        layers.append(ConvBNAct(exp, exp, k, stride, groups=exp, act=act))
        if se:
            layers.append(SqueezeExcitation(exp, _divisible(exp // 4)))
        layers.append(ConvBNAct(exp, cout, 1, act=None))
        self.block = nn.Sequential(*layers)
        self.use_res_connect = stride == 1 and cin == cout

    def forward(self, x):
        y = self.block(x)
        return y + x if self.use_res_connect else y


_SMALL = [(16, 3, 16, 16, True, "RE", 2), (16, 3, 72, 24, False, "RE", 2),
          (24, 3, 88, 24, False, "RE", 1), (24, 5, 96, 40, True, "HS", 2),
          (40, 5, 240, 40, True, "HS", 1), (40, 5, 240, 40, True, "HS", 1),
          (40, 5, 120, 48, True, "HS", 1), (48, 5, 144, 48, True, "HS", 1),
          (48, 5, 288, 96, True, "HS", 2), (96, 5, 576, 96, True, "HS", 1),
          (96, 5, 576, 96, True, "HS", 1)]


class MobileNetV3Small(nn.Module):
    """torchvision's ``mobilenet_v3_small`` (2,542,856 parameters with 1,000 classes)."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        layers = [ConvBNAct(3, 16, 3, 2)]
        layers += [InvertedResidual(*cfg) for cfg in _SMALL]
        layers.append(ConvBNAct(96, 576, 1))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(576, 1024), nn.Hardswish(),
                                        nn.Dropout(0.2), nn.Linear(1024, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class NanoGPT(nn.Module):
    """A nanoGPT-style decoder: token + position embeddings, pre-norm blocks with a fused
    qkv projection and causal ``scaled_dot_product_attention``, GELU MLP, tied LM head."""

    def __init__(self, vocab=32, n_embd=16, n_head=2, n_layer=2, block=8):
        super().__init__()
        self.n_head = n_head
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.h = nn.ModuleList(nn.ModuleDict(dict(
            ln_1=nn.LayerNorm(n_embd), c_attn=nn.Linear(n_embd, 3 * n_embd),
            c_proj=nn.Linear(n_embd, n_embd), ln_2=nn.LayerNorm(n_embd),
            fc=nn.Linear(n_embd, 4 * n_embd), proj=nn.Linear(4 * n_embd, n_embd)))
            for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for blk in self.h:
            q, k, v = blk.c_attn(blk.ln_1(x)).split(x.shape[-1], dim=2)
            q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk.c_proj(y.transpose(1, 2).contiguous().view(b, t, -1))
            x = x + blk.proj(F.gelu(blk.fc(blk.ln_2(x)), approximate="tanh"))
        return self.lm_head(self.ln_f(x))


class UNetBlock(nn.Module):
    """A U-Net up block: GroupNorm + SiLU + conv (reflect padding), nearest and bilinear
    upsampling, a skip concatenation and average pooling."""

    def __init__(self, ch=8, groups=2):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, ch)
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1, padding_mode="reflect")
        self.norm2 = nn.GroupNorm(groups, 2 * ch)
        self.conv2 = nn.Conv2d(2 * ch, ch, 3, padding=1)

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        up = F.interpolate(h, scale_factor=2, mode="nearest")
        skip = F.interpolate(x, size=(2 * x.shape[2], 2 * x.shape[3]), mode="bilinear",
                             align_corners=False)
        h = self.conv2(F.silu(self.norm2(torch.cat([up, skip], 1))))
        return F.avg_pool2d(h, 2) + F.interpolate(x, scale_factor=1.5, mode="nearest")[
            ..., :x.shape[2], :x.shape[3]]


class SmallCNN(nn.Module):
    def __init__(self, classes=5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2)
        self.fc = nn.Linear(8 * 2 * 2, classes)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        h = F.leaky_relu(self.conv2(h), 0.1)
        return self.fc(h.flatten(1))


def mlp(d_in=8, hidden=16, d_out=4) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                         nn.GELU(), nn.Linear(hidden, d_out))
