"""The backbones of the few-shot literature: conv4 and ResNet-12, with stable parameter names.

Both are plain ``nn.Module``\\ s: a ``features`` part and, when ``out_features`` is given, a
linear ``head``. The names are fixed so that ``trainable=`` and ``checkpoint_layers=``
filters are one line: the head alone (ANIL) is ``"head"``, the blocks are ``features.0`` ...
``features.3``.

:func:`conv4` (Vinyals et al., 2016; the MAML papers): four blocks of conv 3x3 (padding 1),
BatchNorm, ReLU and 2x2 max-pooling. Parameters::

    features.{i}.conv.weight   (hidden, in, 3, 3)   i = 0 .. 3
    features.{i}.conv.bias     (hidden,)
    features.{i}.norm.weight   (hidden,)            BatchNorm scale
    features.{i}.norm.bias     (hidden,)
    head.weight                (out_features, hidden * s * s)
    head.bias                  (out_features,)

where ``s`` is the feature map's side after four poolings: 1 for 28x28 Omniglot, 5 for 84x84
mini-ImageNet. :func:`conv4_omniglot` (1 channel, 64 filters) and :func:`conv4_miniimagenet`
(3 channels, 32 filters) are the two standard variants.

:func:`resnet12` (Oreshkin et al., 2018; Lee et al., 2019): four residual blocks, each three
conv 3x3 + BatchNorm + LeakyReLU(0.1) with a 1x1 conv + BatchNorm shortcut, then 2x2
max-pooling; global average pooling at the end. Parameters::

    features.{i}.conv{j}.weight      j = 1 .. 3, no bias
    features.{i}.norm{j}.weight, features.{i}.norm{j}.bias
    features.{i}.shortcut.conv.weight
    features.{i}.shortcut.norm.weight, features.{i}.shortcut.norm.bias
    head.weight, head.bias

BatchNorm: with ``track_running_stats=False`` (the default, as in MAML's reference code) every
forward normalises with the statistics of the batch at hand, support or query, in training
and in evaluation, and the model has no buffers. ``True`` gives ordinary BatchNorm with
running statistics.

Example:
    >>> import torch, funcmeta as fm
    >>> net = fm.models.conv4_omniglot(5)
    >>> net(torch.zeros(2, 1, 28, 28)).shape
    torch.Size([2, 5])
    >>> [k for k in dict(net.named_parameters()) if k.startswith("features.0")]
    ['features.0.conv.weight', 'features.0.conv.bias', 'features.0.norm.weight', 'features.0.norm.bias']
    >>> fm.models.resnet12(None, channels=(8, 8, 8, 8))(torch.zeros(2, 3, 28, 28)).shape
    torch.Size([2, 8])
"""

from funcmeta._src.models.backbones import (
    ResidualBlock,
    conv4,
    conv4_miniimagenet,
    conv4_omniglot,
    resnet12,
)

__all__ = ["ResidualBlock", "conv4", "conv4_miniimagenet", "conv4_omniglot", "resnet12"]
