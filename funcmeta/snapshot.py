"""Snapshots of meta-training: save and restore the whole training state, atomically, to
resume a run.

:func:`save` writes, in one file:

- the state of every module you name: the model (its initial parameters and buffers) and the
  learnable hyperparameters (``fm.hyper`` trees);
- every outer optimizer (and scheduler);
- every generator your task samplers draw from: ``torch.Generator``, NumPy's
  ``Generator`` (``np.random.default_rng``), its bit generators and ``RandomState``, and
  Python's ``random.Random``;
- the global random states (torch CPU and CUDA, Python's ``random``, NumPy's when NumPy is
  loaded);
- the step and any extra picklable values.

The file is written to a temporary name in the same folder, flushed to disk and renamed over
the target. A run killed at any moment leaves either the previous complete state or the new
one, never a torn file. (A process killed during a write may leave its temporary
``.<name>.*.tmp`` file behind; it can be deleted.) :func:`load` restores all of it.

Loading never runs code: the file holds only tensors, numbers, strings, ``None`` and
lists, tuples and dicts of them, and :func:`load` reads it with ``torch.load(...,
weights_only=True)``, which refuses anything else. ``extra`` is limited to those types and
checked by :func:`save`. A file that is not a funcmeta snapshot, a truncated one, one from a
newer format and one that would build other objects each raise :class:`SnapshotError`
naming the file and the cause, before anything is restored; so does a file whose records do
not match the CRC-32 stored with each (a flipped bit anywhere in the data). A run resumed from the last
state continues bit for bit as if it had not stopped (tested by killing a training
subprocess).

Example:
    >>> import tempfile, pathlib, torch, funcmeta as fm
    >>> net = torch.nn.Linear(1, 1)
    >>> outer = torch.optim.Adam(net.parameters(), lr=1e-3)
    >>> rng = torch.Generator().manual_seed(0)
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "state.pt"
    >>> fm.snapshot.save(path, step=10, modules={"net": net}, optimizers={"outer": outer}, generators={"tasks": rng})
    >>> fm.snapshot.load(path, modules={"net": net}, optimizers={"outer": outer}, generators={"tasks": rng}).step
    10
"""

from funcmeta._src.snapshot.files import FORMAT, Snapshot, SnapshotError, load, save

__all__ = ["FORMAT", "Snapshot", "SnapshotError", "load", "save"]
