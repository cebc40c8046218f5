"""Task distributions for meta-learning.

Example:
    >>> import torch, funcmeta as fm
    >>> tasks = fm.data.Sinusoid()
    >>> batch = tasks.sample(4, support=10, query=15, generator=torch.Generator().manual_seed(0))
    >>> batch.x_support.shape, batch.y_query.shape
    (torch.Size([4, 10, 1]), torch.Size([4, 15, 1]))
"""

from funcmeta._src.data.download import OMNIGLOT_FILES, OMNIGLOT_URL, download_omniglot
from funcmeta._src.data.episodes import (
    ClassLabels,
    EpisodeBatch,
    Episodes,
    omniglot_characters,
    split_classes,
)
from funcmeta._src.data.omniglot import load_omniglot, load_omniglot_runs, missing_omniglot_files
from funcmeta._src.data.sinusoid import Sinusoid, SinusoidBatch

__all__ = [
    "ClassLabels",
    "EpisodeBatch",
    "OMNIGLOT_FILES",
    "OMNIGLOT_URL",
    "Episodes",
    "Sinusoid",
    "SinusoidBatch",
    "download_omniglot",
    "load_omniglot",
    "load_omniglot_runs",
    "missing_omniglot_files",
    "omniglot_characters",
    "split_classes",
]
