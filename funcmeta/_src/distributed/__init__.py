"""Task-parallel meta-training (:mod:`funcmeta.distributed`): ``collectives`` shards a
meta-batch over the ranks and averages the meta-gradients with plain collectives, checking
first that every rank averages the same tensors and waiting for peers at most a timeout."""
