"""fm.distributed.shard_model(..., compute_on_shards=...): an embedding and a linear head
computed on their shards (never gathered) give the unsharded run's adapted parameters and
second-order meta-gradients in float64, on 2 and 4 gloo ranks: a vocabulary that does not
split evenly, a rank with no rows, a padding row, checkpointed or not, stepped with SGD or
Adam, and with every replicated activation split across the ranks (what the layers save of
their own part stays whole). A rank never gathers their weights; ids out of the vocabulary raise as torch's embedding
does; layers that cannot compute on their shards are refused by name before anything is
placed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import NEEDS_SHARDED, spawn_gloo
from torch import nn

import funcmeta as fm

pytestmark = NEEDS_SHARDED


class _Tokens(nn.Module):
    """An embedding, a hidden layer and a head over a vocabulary of ``vocab`` ids."""

    def __init__(self, vocab: int, width: int = 5, padding: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, width, padding_idx=padding)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(ids))))


ON_SHARDS = ["embed", "head"]


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), ids.flatten())


def _ids(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (3, 4), generator=g) for _ in range(4)]


def _meta(net: nn.Module, checkpoint_layers, opt_name: str) -> list[torch.Tensor]:
    """fm.adapt (3 steps, second order) and the query loss's backward: the adapted
    parameters, then the meta-gradients (whole tensors)."""
    fmodel = fm.functional_model(net, checkpoint_layers=checkpoint_layers)
    xs, ys, xq, yq = _ids(net.vocab)
    opt = fm.optim.sgd(lr=0.5) if opt_name == "sgd" else fm.optim.adam(lr=0.05)
    result = fm.adapt(fmodel, fmodel.params, _loss, (xs, ys), opt, steps=3)
    _loss(fmodel(result.params, xq), yq).backward()

    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    return [whole(t).detach() for t in result.params.values()] + [
        whole(p.grad) for p in net.parameters()
    ]


#: (vocabulary, padding row, checkpointed layers, optimizer): 7 rows split 4 + 3 on 2 ranks
#: and 2 + 2 + 2 + 1 on 4; 3 rows leave the fourth rank none.
RUNS = [
    (7, 5, None, "sgd"),
    (7, 5, ["embed", "hidden", "head"], "sgd"),
    (7, None, None, "adam"),
    (3, None, None, "sgd"),
]


def _case_on_shards(world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from funcmeta._src.distributed import comm

    mesh = init_device_mesh("cpu", (world,))
    results: dict = {}
    gathered: list[str] = []
    gather_whole = comm.gather_whole

    def noted(shard, what):
        gathered.append(what)
        return gather_whole(shard, what)

    comm.gather_whole = noted
    try:
        for vocab, padding, checkpoint_layers, opt_name in RUNS:
            net = fm.distributed.shard_model(
                _Tokens(vocab, padding=padding).double(), mesh, compute_on_shards=ON_SHARDS
            )
            key = (vocab, padding, repr(checkpoint_layers), opt_name)
            results[key] = _meta(net, checkpoint_layers, opt_name)
    finally:
        comm.gather_whole = gather_whole
    results["gathered"] = gathered
    results["split"] = _every_activation_split(mesh)
    net = fm.distributed.shard_model(_Tokens(7).double(), mesh, compute_on_shards=ON_SHARDS)
    for bad in (7, -1):
        try:
            net(torch.tensor([[0, bad]]))
        except IndexError as error:
            results[f"id {bad}"] = str(error)
    return results


def _every_activation_split(mesh) -> dict:
    """Each run again with every replicated activation the entry points save split across
    the ranks (the size threshold lowered to 1 element), and the head trained whole: what
    the layers on their shards save of their own part (their shards, their slices of a
    gradient) must stay whole, or the gathers mix the ranks' values. The meta-gradients of
    each run and the number of slices kept."""
    from funcmeta._src.distributed import runtime

    kept = [0]
    original, threshold = runtime._Piece.__init__, runtime._SPLIT_MIN

    def counting(self, *args):
        kept[0] += 1
        original(self, *args)

    runtime._SPLIT_MIN, runtime._Piece.__init__ = 1, counting
    out: dict = {}
    try:
        for vocab, padding, checkpoint_layers, opt_name in RUNS:
            net = fm.distributed.shard_model(
                _Tokens(vocab, padding=padding).double(), mesh, compute_on_shards=ON_SHARDS
            )
            assert fm.functional_model(net).runtime.split
            before = kept[0]
            grads = _meta(net, checkpoint_layers, opt_name)
            out[(vocab, padding, repr(checkpoint_layers), opt_name)] = (grads, kept[0] - before)
    finally:
        runtime._SPLIT_MIN, runtime._Piece.__init__ = threshold, original
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_an_embedding_and_head_on_their_shards_give_the_unsharded_meta_gradients(world):
    results = spawn_gloo(world, _case_on_shards)
    for vocab, padding, checkpoint_layers, opt_name in RUNS:
        key = (vocab, padding, repr(checkpoint_layers), opt_name)
        theirs = _meta(_Tokens(vocab, padding=padding).double(), checkpoint_layers, opt_name)
        if padding is not None:  # the padding row gets no gradient, as unsharded
            assert theirs[-5][padding].abs().max() == 0  # the embedding's
        for ours in results:
            for a, b in zip(ours[key], theirs, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15, msg=str(key))
            split, count = ours["split"][key]
            assert count > 0, key  # the replicated activations were split
            for a, b in zip(split, theirs, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15, msg=f"split {key}")
    for ours in results:
        # only the hidden layer's weight and bias are ever gathered
        assert ours["gathered"], "nothing was gathered"
        assert all("'weight'" in w or "'bias'" in w for w in ours["gathered"])
        assert all("Linear" in w for w in ours["gathered"])
        assert len(ours["gathered"]) % 2 == 0
        for bad in (7, -1):
            assert f"id {bad} is out of range for an embedding of 7 rows" in ours[f"id {bad}"]


class _OwnForward(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def _case_refusals(world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    said: dict = {}
    attempts = {
        "a string": lambda: _Tokens(7).double(),
        "no layer": lambda: _Tokens(7).double(),
        "a container": lambda: nn.Sequential(_Tokens(7)),
        "own forward": lambda: nn.Sequential(_OwnForward(3, 3)),
        "max_norm": lambda: nn.Sequential(nn.Embedding(5, 3, max_norm=1.0)),
    }
    names = {
        "a string": "head",
        "no layer": ["lm_head"],
        "a container": ["0"],
        "own forward": ["0"],
        "max_norm": ["0"],
    }
    for what, build in attempts.items():
        module = build()
        try:
            fm.distributed.shard_model(module, mesh, compute_on_shards=names[what])
        except (TypeError, fm.distributed.ShardingError) as error:
            said[what] = (type(error).__name__, str(error))
        said[f"{what}: placed"] = any(type(p).__name__ == "DTensor" for p in module.parameters())
    return said


def test_what_cannot_compute_on_its_shards_is_refused_before_anything_is_placed():
    (said, _) = spawn_gloo(2, _case_refusals)
    assert said["a string"][0] == "TypeError"
    assert "got str 'head': put it in a list" in said["a string"][1]
    assert "'lm_head' is not a layer of the module (did you mean ['head']?)" in said["no layer"][1]
    assert "'0' is a _Tokens; only an nn.Embedding" in said["a container"][1]
    assert "'0' is a _OwnForward" in said["own forward"][1]
    assert "max_norm=, which renormalizes the rows" in said["max_norm"][1]
    for what in ("a string", "no layer", "a container", "own forward", "max_norm"):
        assert said[f"{what}: placed"] is False, what


def test_a_conjugated_view_is_never_split():
    """A conjugated (or negated) view of a complex activation (``k.mH``) reads its storage's
    values changed: its slice would be keyed as the storage's own, and a later save of ``k``
    would get the conjugated values. Such a view is kept whole."""
    from funcmeta._src.distributed import runtime

    k = torch.randn(64, 64, dtype=torch.complex128)
    assert runtime._splittable(k) and runtime._splittable(k.t())
    assert not runtime._splittable(k.mH)
    assert not runtime._splittable(k.conj())
    assert not runtime._splittable(torch.randn(64, 64, dtype=torch.complex128).conj()._neg_view())


def _frozen(world: int) -> dict:
    """The hidden layer and the head frozen, all three layers on their shards (every
    replicated activation split), adapted and meta-trained through the embedding alone: the
    meta-gradients, and which of the split linear layers kept their input for the backward."""
    from torch.distributed.device_mesh import init_device_mesh

    from funcmeta._src.distributed import runtime

    mesh = init_device_mesh("cpu", (world,))
    threshold, runtime._SPLIT_MIN = runtime._SPLIT_MIN, 1
    try:
        out = {}
        for layers in (None, ["hidden"]):
            net = _frozen_tokens()
            fm.distributed.shard_model(net, mesh, compute_on_shards=["embed", "hidden", "head"])
            out[repr(layers)] = _meta(net, layers, "sgd")
    finally:
        runtime._SPLIT_MIN = threshold
    net = _frozen_tokens()
    net.hidden.weight.requires_grad_(True)  # trainable: its input is kept
    fm.distributed.shard_model(net, mesh, compute_on_shards=["embed", "hidden", "head"])
    loss = _loss(net(_ids(7)[0]), _ids(7)[1])
    kept, seen, todo = {}, set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "_LinearOnShardsBackward":
            kept[node.what] = node.saved_tensors[0] is not None
        todo += [n for n, _ in node.next_functions]
    out["kept"] = kept
    return out


def _frozen_tokens() -> _Tokens:
    net = _Tokens(7).double()
    for p in [*net.hidden.parameters(), *net.head.parameters()]:
        p.requires_grad_(False)
    return net


def test_a_frozen_layer_on_its_shards_keeps_no_input_and_gives_the_unsharded_meta_gradients():
    """A frozen linear layer's backward reads its shard, never its input: it keeps none, and
    the second-order meta-gradients through it are one process's."""
    results = spawn_gloo(2, _frozen)
    for layers in (None, ["hidden"]):
        theirs = _meta(_frozen_tokens(), layers, "sgd")
        for ours in results:
            for a, b in zip(ours[repr(layers)], theirs, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15, msg=repr(layers))
    for ours in results:
        # the trainable hidden layer keeps its input (its weight's gradient reads it); the
        # frozen head none
        assert ours["kept"] == {"Linear 'hidden'": True, "Linear 'head'": False}
