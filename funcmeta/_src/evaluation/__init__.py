"""The few-shot evaluation protocol (:func:`funcmeta.evaluate`, :mod:`funcmeta.evaluation`):
``protocol`` adapts on each episode's support set, scores its query set and reports the mean
accuracy with a 95% confidence interval, by adaptation or by prototypes."""
