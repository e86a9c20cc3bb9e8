"""A tiny RRDBNet (ESRGAN's generator; Real-ESRGAN and 4x-UltraSharp are this network at nf=64, gc=32, 23 blocks)
written here in torch and exported to ONNX, for the upscaler tests (engines/pipelines/upscale.py).

The network as ESRGAN (Wang et al., 2018) defines it: a 3x3 conv, ``blocks`` residual-in-residual dense blocks
(three dense blocks of five 3x3 convs each, LeakyReLU 0.2, residuals scaled by 0.2), a 3x3 conv and a long skip,
then two (nearest x2, conv, LeakyReLU) upsampling stages for x4, a conv with LeakyReLU and the last conv.
Weights are seeded; the last conv is rescaled so outputs spread over [0, 1] (a parity check on a constant image
would prove nothing). torch is build-time only (engines/build/).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812


class DenseBlock(nn.Module):
    """Five 3x3 convs, each fed every earlier feature map; the output scaled by 0.2 and added to the input."""

    def __init__(self, nf: int, gc: int) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(nf + i * gc, gc if i < 4 else nf, 3, 1, 1) for i in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = [x]
        for i, conv in enumerate(self.convs):
            y = conv(torch.cat(feats, 1))
            if i < 4:
                feats.append(F.leaky_relu(y, 0.2))
        return x + 0.2 * y


class RRDB(nn.Module):
    """Three dense blocks in sequence, their result scaled by 0.2 and added to the input."""

    def __init__(self, nf: int, gc: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(DenseBlock(nf, gc) for _ in range(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.2 * self.blocks(x)


class RRDBNet(nn.Module):
    """ESRGAN's x4 generator: RGB in [0, 1] in, RGB 4x larger out (not clamped)."""

    def __init__(self, nf: int = 8, gc: int = 4, blocks: int = 1) -> None:
        super().__init__()
        self.conv_first = nn.Conv2d(3, nf, 3, 1, 1)
        self.body = nn.Sequential(*(RRDB(nf, gc) for _ in range(blocks)))
        self.conv_body = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up1 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up2 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_hr = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_last = nn.Conv2d(nf, 3, 3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feat = self.conv_first(x)
        feat = feat + self.conv_body(self.body(feat))
        feat = F.leaky_relu(self.conv_up1(F.interpolate(feat, scale_factor=2.0, mode="nearest")), 0.2)
        feat = F.leaky_relu(self.conv_up2(F.interpolate(feat, scale_factor=2.0, mode="nearest")), 0.2)
        return self.conv_last(F.leaky_relu(self.conv_hr(feat), 0.2))


RECEPTIVE_RADIUS = 20
"""Input pixels per side that reach one output pixel of ``RRDBNet()`` (17 convs at the input's scale, three more
after upsampling): a tile overlap of this much makes the tiled run equal the whole-image one."""


def tiny_rrdbnet(seed: int = 0) -> RRDBNet:
    """The seeded tiny network, its output spread over about [0.2, 0.8] on natural-looking input."""
    torch.manual_seed(seed)
    net = RRDBNet().eval()
    probe = torch.rand(1, 3, 24, 24, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        out = net(probe)
        net.conv_last.weight.mul_(0.15 / float(out.std()))
        net.conv_last.bias.mul_(0.15 / float(out.std()))
        net.conv_last.bias.add_(0.5 - float(net(probe).mean()))
    return net


def export_rrdbnet(net: nn.Module, path: Path) -> Path:
    """``net`` as an ONNX file with dynamic height and width (opset 17), the layout engines/pipelines/upscale.py
    loads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    dummy = torch.rand(1, 3, 32, 24)
    with torch.no_grad():
        torch.onnx.export(net, (dummy,), str(path), input_names=["image"], output_names=["upscaled"],
                          dynamic_axes={"image": {2: "height", 3: "width"},
                                        "upscaled": {2: "out_height", 3: "out_width"}},
                          opset_version=17, dynamo=False)
    return path
