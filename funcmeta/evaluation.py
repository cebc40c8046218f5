"""The few-shot evaluation protocol: adapt on each episode's support set, score its query set,
report the mean accuracy with a 95% confidence interval.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> images, labels = torch.rand(100, 1, 28, 28), torch.arange(10).repeat_interleave(10)
    >>> episodes = fm.data.Episodes(images, labels, ways=5, shots=1, query=3)
    >>> fmodel = fm.functional_model(fm.models.conv4_omniglot(5, hidden=8))
    >>> result = fm.evaluate(fmodel, fmodel.params, F.cross_entropy, episodes,
    ...                      fm.optim.sgd(lr=0.4), steps=3, num_episodes=20)
    >>> result.per_episode.shape, 0 <= result.accuracy <= 1
    (torch.Size([20]), True)
"""

from funcmeta._src.evaluation.protocol import Evaluation, evaluate, mean_ci

__all__ = ["Evaluation", "evaluate", "mean_ci"]
