"""What a batch's inputs mean as a call of the model.

A batch is ``(inputs, targets)``. ``inputs`` become the model's arguments: a tuple is
positional arguments, a mapping keyword arguments, :class:`funcmeta.Args` both, anything else the one
positional argument. Under task batching every tensor among the inputs carries the leading
task axis; :class:`TaskAxisError` names a batch whose task axis is wrong, and
:class:`TaskAxisSuspect` a batch for a single task that still seems to carry one.

Example:
    >>> import torch, funcmeta as fm
    >>> args, kwargs = fm.inputs.split_inputs(fm.Args(torch.ones(2), scale=3.0))
    >>> len(args), sorted(kwargs)
    (1, ['scale'])
"""

from funcmeta._src.inner.inputs import Args as Args
from funcmeta._src.inner.inputs import TaskAxisError as TaskAxisError
from funcmeta._src.inner.inputs import TaskAxisSuspect as TaskAxisSuspect
from funcmeta._src.inner.inputs import split_batch as split_batch
from funcmeta._src.inner.inputs import split_inputs as split_inputs

__all__ = ["Args", "TaskAxisError", "TaskAxisSuspect", "split_batch", "split_inputs"]
