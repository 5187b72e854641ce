"""An SD-style convolutional U-Net (the benchmark's "SD U-Net" workload): residual blocks of
GroupNorm → SiLU → conv3×3 (twice, plus a 1×1 shortcut when the width changes), stride-2
convolutions down, nearest ×2 upsampling + conv3×3 up, skip connections concatenated on the
channel axis, a GroupNorm → SiLU → conv3×3 head, MSE loss against a target.

Default: 3 levels of 64/128/128 channels (base 64, mults 1, 2, 2), one residual block per
level, 4-channel 32×32 latents — 2,493,124 parameters.  No timestep embedding or attention
(those belong to the transformer workloads).  Names follow diffusers (``conv_in``,
``down_blocks.{i}.resnets.{j}.norm1``, ``down_blocks.{i}.downsamplers.0.conv``,
``mid_block.resnets.0``, ``up_blocks.{i}.upsamplers.0.conv``, ``conv_norm_out``,
``conv_out``)."""

from __future__ import annotations

from dataclasses import dataclass

from .. import ops
from ..graph import Graph, Value
from ..nn import Conv2d, GroupNorm, upsample_nearest2d

__all__ = ["UNetConfig", "UNetGraph", "unet", "PRESETS"]


@dataclass(frozen=True)
class UNetConfig:
    in_channels: int = 4
    out_channels: int = 4
    base: int = 64
    mults: tuple[int, ...] = (1, 2, 2)
    num_res_blocks: int = 1
    groups: int = 32
    eps: float = 1e-5
    image_size: int = 32

    @property
    def channels(self) -> list[int]:
        return [self.base * m for m in self.mults]


PRESETS = {
    "sd-unet": UNetConfig(),
    "sd-unet-tiny": UNetConfig(base=8, groups=4, image_size=8),
}


@dataclass
class UNetGraph:
    graph: Graph
    x: Value  # (batch, in_channels, H, W)
    target: Value  # (batch, out_channels, H, W)
    out: Value
    loss: Value  # mean squared error
    config: UNetConfig


def _resblock(g: Graph, x: Value, cin: int, cout: int, cfg: UNetConfig, name: str) -> Value:
    h = GroupNorm(cfg.groups, cin, cfg.eps, name=f"{name}.norm1")(g, x).silu()
    h = Conv2d(cin, cout, 3, padding=1, name=f"{name}.conv1")(g, h)
    h = GroupNorm(cfg.groups, cout, cfg.eps, name=f"{name}.norm2")(g, h).silu()
    h = Conv2d(cout, cout, 3, padding=1, name=f"{name}.conv2")(g, h)
    if cin != cout:
        x = Conv2d(cin, cout, 1, name=f"{name}.conv_shortcut")(g, x)
    return x + h


def unet(cfg: UNetConfig | str, batch: int) -> UNetGraph:
    if isinstance(cfg, str):
        cfg = PRESETS[cfg]
    levels = len(cfg.mults)
    if cfg.image_size % 2 ** (levels - 1):
        raise ValueError(f"image_size {cfg.image_size} must be divisible by "
                         f"{2 ** (levels - 1)} ({levels} levels)")
    g = Graph("unet")
    s = cfg.image_size
    x = g.input("x", (batch, cfg.in_channels, s, s))
    target = g.input("target", (batch, cfg.out_channels, s, s))
    chans = cfg.channels
    h = Conv2d(cfg.in_channels, chans[0], 3, padding=1, name="conv_in")(g, x)
    cin, skips = chans[0], []
    for lvl, ch in enumerate(chans):
        for j in range(cfg.num_res_blocks):
            h = _resblock(g, h, cin, ch, cfg, f"down_blocks.{lvl}.resnets.{j}")
            cin = ch
        skips.append((h, ch))
        if lvl < levels - 1:
            h = Conv2d(ch, ch, 3, stride=2, padding=1,
                       name=f"down_blocks.{lvl}.downsamplers.0.conv")(g, h)
    h = _resblock(g, h, cin, cin, cfg, "mid_block.resnets.0")
    for i, lvl in enumerate(reversed(range(levels))):
        ch = chans[lvl]
        skip, sch = skips.pop()
        h = ops.concat([h, skip], 1)
        cin += sch
        for j in range(cfg.num_res_blocks):
            h = _resblock(g, h, cin, ch, cfg, f"up_blocks.{i}.resnets.{j}")
            cin = ch
        if lvl > 0:
            h = upsample_nearest2d(h, 2)
            h = Conv2d(ch, ch, 3, padding=1, name=f"up_blocks.{i}.upsamplers.0.conv")(g, h)
    h = GroupNorm(cfg.groups, cin, cfg.eps, name="conv_norm_out")(g, h).silu()
    out = Conv2d(cin, cfg.out_channels, 3, padding=1, name="conv_out")(g, h)
    return UNetGraph(g, x, target, out, ops.mse_loss(out, target), cfg)
