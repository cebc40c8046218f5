"""Keeping freed CPU memory in the process (:func:`funcmeta.keep_freed_memory`,
:mod:`funcmeta.cpu_memory`): ``glibc`` sets the C library's malloc so that large tensors
stop costing page faults, and says why it cannot where it cannot."""
