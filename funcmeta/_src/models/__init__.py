"""The few-shot backbones (:mod:`funcmeta.models`): ``backbones`` builds conv4 and ResNet-12
with fixed parameter names, so that the filters of ``trainable=`` and
``checkpoint_layers=`` are one line each."""
