"""Snapshots of a training run (:mod:`funcmeta.snapshot`): ``files`` saves and loads them
(atomic writes, format checks, checksums); ``records`` checks each record's CRC-32 before
anything is unpickled; ``rng_state`` reads and restores the states of the generators a
run names. Nothing else in funcmeta uses them."""
