"""The few-shot backbones, conv4 and ResNet-12: the implementation of :mod:`funcmeta.models`."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from funcmeta._src.core.checks import check_int
from funcmeta._src.core.exposed import exposed_in

__all__ = ["ResidualBlock", "conv4", "conv4_miniimagenet", "conv4_omniglot", "resnet12"]


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        check_int(value, name, low=1, what="a positive int")


def _pooled_side(image_size: int, pools: int) -> int:
    side = image_size
    for _ in range(pools):
        side //= 2
    if side < 1:
        raise ValueError(
            f"image_size {image_size} is too small for {pools} 2x2 poolings (at least "
            f"{2**pools} pixels)"
        )
    return side


def _with_head(features: nn.Module, width: int, out_features: int | None) -> nn.Sequential:
    parts: OrderedDict[str, nn.Module] = OrderedDict(features=features, flatten=nn.Flatten())
    if out_features is not None:
        _check_positive(out_features=out_features)
        parts["head"] = nn.Linear(width, out_features)
    return nn.Sequential(parts)


@exposed_in("funcmeta.models")
def conv4(
    out_features: int | None,
    *,
    in_channels: int = 1,
    hidden: int = 64,
    image_size: int = 28,
    track_running_stats: bool = False,
) -> nn.Sequential:
    """The conv4 backbone: four (conv 3x3, BatchNorm, ReLU, max-pool 2) blocks, flattened, then
    a ``Linear(hidden * s * s, out_features)`` head (none when ``out_features`` is ``None``:
    the embedding of metric-based methods such as Prototypical Networks). ``image_size`` is
    the side of the square inputs; it fixes ``s``."""
    _check_positive(in_channels=in_channels, hidden=hidden, image_size=image_size)
    side = _pooled_side(image_size, 4)
    blocks = nn.Sequential()
    for i in range(4):
        block = OrderedDict(
            conv=nn.Conv2d(in_channels if i == 0 else hidden, hidden, 3, padding=1),
            norm=nn.BatchNorm2d(hidden, track_running_stats=track_running_stats),
            relu=nn.ReLU(),
            pool=nn.MaxPool2d(2),
        )
        blocks.add_module(str(i), nn.Sequential(block))
    return _with_head(blocks, hidden * side * side, out_features)


@exposed_in("funcmeta.models")
def conv4_omniglot(out_features: int | None, **kwargs: int | bool) -> nn.Sequential:
    """conv4 for 1x28x28 Omniglot: 64 filters, 64 features."""
    options: dict[str, Any] = {"in_channels": 1, "hidden": 64, "image_size": 28, **kwargs}
    return conv4(out_features, **options)


@exposed_in("funcmeta.models")
def conv4_miniimagenet(out_features: int | None, **kwargs: int | bool) -> nn.Sequential:
    """conv4 for 3x84x84 mini-ImageNet: 32 filters, 800 features."""
    options: dict[str, Any] = {"in_channels": 3, "hidden": 32, "image_size": 84, **kwargs}
    return conv4(out_features, **options)


@exposed_in("funcmeta.models")
class ResidualBlock(nn.Module):
    """ResNet-12's block: three conv 3x3 + BatchNorm (LeakyReLU 0.1 after the first two), a
    1x1 conv + BatchNorm shortcut, the sum through LeakyReLU, then 2x2 max-pooling."""

    def __init__(self, cin: int, cout: int, *, track_running_stats: bool = False) -> None:
        super().__init__()

        def norm() -> nn.BatchNorm2d:
            return nn.BatchNorm2d(cout, track_running_stats=track_running_stats)

        self.conv1, self.norm1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False), norm()
        self.conv2, self.norm2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False), norm()
        self.conv3, self.norm3 = nn.Conv2d(cout, cout, 3, padding=1, bias=False), norm()
        self.shortcut = nn.Sequential(
            OrderedDict(conv=nn.Conv2d(cin, cout, 1, bias=False), norm=norm())
        )
        self.act = nn.LeakyReLU(0.1)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: Tensor) -> Tensor:
        out = self.act(self.norm1(self.conv1(x)))
        out = self.act(self.norm2(self.conv2(out)))
        out = self.norm3(self.conv3(out))
        return self.pool(self.act(out + self.shortcut(x)))


@exposed_in("funcmeta.models")
def resnet12(
    out_features: int | None,
    *,
    in_channels: int = 3,
    channels: Sequence[int] = (64, 160, 320, 640),
    track_running_stats: bool = False,
) -> nn.Sequential:
    """ResNet-12: four :class:`ResidualBlock` with ``channels`` filters, global average
    pooling, then a ``Linear(channels[-1], out_features)`` head (none for ``None``). Inputs
    need at least 16 pixels a side (84x84 for mini-ImageNet, 28x28 for Omniglot with
    ``in_channels=1``)."""
    channels = tuple(channels)
    if len(channels) != 4:
        raise ValueError(f"channels must give 4 widths, one per block, got {channels}")
    _check_positive(
        in_channels=in_channels, **{f"channels[{i}]": c for i, c in enumerate(channels)}
    )
    blocks = nn.Sequential()
    for i, cout in enumerate(channels):
        cin = in_channels if i == 0 else channels[i - 1]
        blocks.add_module(str(i), ResidualBlock(cin, cout, track_running_stats=track_running_stats))
    blocks.add_module("avgpool", nn.AdaptiveAvgPool2d(1))
    return _with_head(blocks, channels[-1], out_features)
