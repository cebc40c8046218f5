"""Per-layer activation checkpointing of a module's *pure* layer functions.

:func:`funcmeta.functional_model` takes ``checkpoint_layers=`` to choose layers. Each chosen
layer runs as a pure function of its parameters, buffers and inputs (the layer called through
``torch.func.functional_call`` with exactly those tensors), under
``funcmeta._src.checkpoint.engine.checkpoint``:

- the forward keeps only those tensors, not the layer's activations;
- a backward recomputes the layer and takes its vector-Jacobian product (the inner gradient
  of a second-order step takes it on the forward's graph, kept until then and dropped);
- a backward that is itself recorded (``autograd.grad(create_graph=True)``, the inner loop of
  second-order MAML) keeps one node per layer holding the layer's inputs and incoming
  gradients; the outer backward recomputes the layer, its backward and the derivative of
  that, one layer at a time. So per-layer checkpointing saves memory in second order too
  (``jax.checkpoint`` under grad-of-grad keeps the inner forward's activations; see
  ``docs/memory.md``).

The parameters are explicit inputs of the pure function, so every recomputation uses the
tensors of the forward (adapted parameters included), never whatever the module holds at
that time. Recomputations replay the forward's random number generator states (dropout
masks), autocast and kernel choice; BatchNorm statistics are written once, by the forward
(recomputations start from a snapshot of the buffers and write into copies). A checkpointed
layer must not write into its inputs in place (they are kept for the recomputation): that
raises.

The user's module is not modified. A private shadow of the module tree shares every
parameter and buffer by reference (``funcmeta._src.module.shadow``). Only the modules on the path to a
checkpointed layer are shallow copies, and the chosen layers are stand-ins.

Example:
    >>> import torch, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> fm.checkpoint.select(net, "sequential")
    ['0', '2']
    >>> fmodel = fm.functional_model(net, checkpoint_layers="sequential")
    >>> x = torch.randn(4, 2)
    >>> torch.allclose(fmodel(fmodel.params, x), net(x))
    True
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from funcmeta._src.checkpoint.engine import checkpoint
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.fence import buffer_dict, parameter_dict
from funcmeta._src.core.tree import Predicate
from funcmeta._src.core.vmap import any_batched, call_outside_vmap
from funcmeta._src.module.guard import guard_of
from funcmeta._src.module.shadow import Standin, ancestors, relative, shadow, within

__all__ = [
    "PRESETS",
    "CheckpointSpec",
    "TensorSlots",
    "checkpointed_runner",
    "is_checkpointed_layer",
    "select",
]

CheckpointSpec = None | str | Sequence[str] | Predicate
"""``None``; a preset name (see :data:`PRESETS`); submodule names; or a predicate
``(name, module) -> bool`` (:data:`funcmeta.tree.Predicate`)."""


def _has_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _sequential_children(root: nn.Module) -> list[str]:
    out = []
    for name, m in root.named_modules():
        if isinstance(m, nn.Sequential | nn.ModuleList):
            prefix = f"{name}." if name else ""
            out += [prefix + c for c, child in m.named_children() if _has_tensors(child)]
    return out


def _leaves(root: nn.Module) -> list[str]:
    return [
        name
        for name, m in root.named_modules()
        if name and not any(True for _ in m.children()) and _has_tensors(m)
    ]


PRESETS: dict[str, Callable[[nn.Module], list[str]]] = {
    "sequential": _sequential_children,
    "leaves": _leaves,
}
"""Named layer choices. ``"sequential"`` selects every child, with parameters or buffers, of each
``nn.Sequential``/``nn.ModuleList`` (outermost first: the blocks of a network of blocks).
``"leaves"`` selects every module without children that holds parameters or buffers. (They
say *which layers* are checkpointed, not what a checkpoint saves, as a ``jax.checkpoint``
policy would.)"""


@exposed_in("funcmeta.checkpoint")
def select(module: nn.Module, spec: CheckpointSpec) -> list[str]:
    """The names of the submodules ``spec`` chooses, outermost only, in module order.

    Raises ``ValueError`` for an unknown preset, unknown names (listing them), explicitly
    named modules nested in one another, or a predicate or preset that matches nothing.
    """
    if spec is None:
        return []
    if isinstance(spec, bool) or (not isinstance(spec, str | Sequence) and not callable(spec)):
        raise TypeError(
            f"checkpoint_layers must be None, a preset name {sorted(PRESETS)}, a list of submodule "
            f"names or a predicate (name, module) -> bool; got {spec!r}"
        )
    named = dict(module.named_modules())
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(
                f"unknown checkpoint preset {spec!r}; presets are {sorted(PRESETS)} "
                "(pass submodule names as a list)"
            )
        chosen = PRESETS[spec](module)
        what = f"preset {spec!r}"
    elif callable(spec):
        chosen = [name for name, m in named.items() if spec(name, m)]
        what = "the checkpoint predicate"
    else:
        chosen = list(spec)
        if not all(isinstance(n, str) for n in chosen):
            raise TypeError("checkpoint names must be strings")
        unknown = [n for n in chosen if n not in named]
        if unknown:
            available = [n for n in named if n]
            raise ValueError(
                f"checkpoint names {unknown} are not submodules; submodules are {available}"
            )
        nested = [n for n in chosen if any(a in chosen for a in ancestors(n))]
        if nested:
            raise ValueError(f"checkpoint names {nested} lie inside other checkpointed modules")
        what = "the checkpoint names"
    chosen_set = set(chosen)
    outermost = [
        n for n in named if n in chosen_set and not any(a in chosen_set for a in ancestors(n))
    ]
    if not outermost:
        raise ValueError(f"{what} matches no submodule of {type(module).__name__}")
    return outermost


class TensorSlots:
    """The places (parameter and buffer dicts, by name) of the tensors of some modules, one
    entry per distinct tensor (a tied weight's places together), in the order of
    ``named_parameters`` and ``named_buffers``.

    :meth:`holding` runs a block with other tensors in those places. It writes the dicts
    directly, as ``torch.func.functional_call`` does, without its name lookups: a
    checkpointed layer runs once per forward and once per recomputation, and on a GPU that
    bookkeeping took longer than the layer's kernels."""

    def __init__(self, modules: list[nn.Module]) -> None:
        # a recomputation in a backward must not meet another thread's run of the model
        self.guard = guard_of(modules[0]) if modules else None
        # Places only, no tensors: a checkpointed layer's recomputation closes over its
        # slots for as long as the graph lives, and a tensor held here (the adapted
        # parameters of an inner step or of the query pass) would outlive its last use in
        # the backward.
        self.params: list[list[tuple[dict, str]]] = []
        self.buffers: list[list[tuple[dict, str]]] = []
        seen: set[tuple[int, str]] = set()
        for dict_of, out in ((parameter_dict, self.params), (buffer_dict, self.buffers)):
            index: dict[int, int] = {}
            for root in modules:
                for m in root.modules():
                    d = dict_of(m)
                    for key, t in d.items():
                        if t is None or (id(d), key) in seen:
                            continue
                        seen.add((id(d), key))
                        if id(t) not in index:
                            index[id(t)] = len(out)
                            out.append([])
                        out[index[id(t)]].append((d, key))

    def tensors(self) -> tuple[list[Tensor], list[Tensor]]:
        """The parameters and buffers in the places now (each entry's first place)."""

        def now(places: list[tuple[dict, str]]) -> Tensor:
            where, key = places[0]
            return where[key]

        return [now(p) for p in self.params], [now(b) for b in self.buffers]

    @contextlib.contextmanager
    def holding(
        self, params: Sequence[Tensor], buffers: Sequence[Tensor], keep_replaced: bool
    ) -> Iterator[None]:
        """These tensors in the places for the block; the previous ones back after it. With
        ``keep_replaced``, a buffer the block replaced (``self.count = self.count + 1``)
        stays, for the run to collect."""
        with self.guard or contextlib.nullcontext():
            saved: list[tuple[dict, str, Any, Any, bool]] = []
            groups = ((self.params, params, False), (self.buffers, buffers, True))
            try:
                for entries, values, is_buffer in groups:
                    for places, value in zip(entries, values, strict=True):
                        for d, key in places:
                            saved.append((d, key, d[key], value, is_buffer))
                            d[key] = value
                yield
            finally:
                for d, key, old, value, is_buffer in reversed(saved):
                    if keep_replaced and is_buffer and d[key] is not value:
                        continue
                    d[key] = old


class _Checkpointed(Standin):
    """Runs its layer as a checkpointed pure function (see the module docstring). ``inner``
    runs like the layer: the layer itself, or a shadow of it with stand-ins inside."""

    def __init__(self, original: nn.Module, inner: nn.Module, name: str = "") -> None:
        super().__init__(original)
        self.__dict__["_fm_inner"] = inner
        self.__dict__["_fm_name"] = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        original = self.__dict__["_fm_original"]
        inner = self.__dict__["_fm_inner"]
        slots = TensorSlots([original])
        ptensors, btensors = slots.tensors()
        n_p, n_b = len(ptensors), len(btensors)
        _refuse_cache(self.__dict__["_fm_name"], args, kwargs)
        calls = [0]

        def layer_fn(inputs: tuple[Any, ...], kw: dict[str, Any], live: list[Tensor]) -> Any:
            # The forward writes into the real buffers (BatchNorm running statistics), once;
            # a recomputation starts from the buffers as they were before the forward and
            # writes into copies.
            first = calls[0] == 0
            buffers = list(live) if first else [v.clone() for v in inputs[n_p : n_p + n_b]]
            calls[0] += 1
            with slots.holding(inputs[:n_p], buffers, keep_replaced=False):
                return inner(*inputs[n_p + n_b :], **kw)

        # The first run may write into the buffers: the recomputations get snapshots of them
        # as they were before it (for BatchNorm, a few numbers).
        snapshots = [b.clone() for b in btensors]
        inputs = (*ptensors, *snapshots, *args)
        if any_batched(inputs, kwargs):
            # Under task batching (vmap): checkpoint(vmap(layer)) outside the vmap level.
            return call_outside_vmap(
                lambda f, flat: checkpoint(f, *flat),
                layer_fn,
                (inputs, kwargs),
                extra=(list(btensors),),
            )
        return checkpoint(lambda inp, kw: layer_fn(inp, kw, btensors), inputs, kwargs)


def is_checkpointed_layer(function: Any) -> bool:
    """Whether ``function`` is a layer that ``checkpoint_layers`` chose (it checkpoints
    itself when called)."""
    return isinstance(function, _Checkpointed)


def _is_kv_cache(value: Any) -> bool:
    """Whether ``value`` is a HuggingFace key/value cache (a ``transformers`` ``Cache``)."""
    return any(
        c.__name__ == "Cache" and c.__module__.startswith("transformers")
        for c in type(value).__mro__
    )


def _refuse_cache(layer: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise if a checkpointed layer is given a key/value cache: its first run appends to the
    cache, and every recomputation would append again and attend to the stale entries
    (silently wrong gradients)."""
    given = [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    for where, value in given:
        if _is_kv_cache(value):
            raise ValueError(
                f"checkpointed layer {layer!r} was given a key/value cache ({where}="
                f"{type(value).__name__}): each recomputation of the layer would append to "
                "it again. Turn the cache off: build the model with config.use_cache=False, "
                "or call it with use_cache=False (HuggingFace does the same for gradient "
                "checkpointing)"
            )


def checkpointed_runner(
    module: nn.Module,
    names: list[str],
    standins: Mapping[str, Callable[[nn.Module], nn.Module]] | None = None,
) -> tuple[nn.Module, list[tuple[nn.Module, nn.Module]]]:
    """A shadow of ``module`` with the layers ``names`` checkpointed and the submodules named
    in ``standins`` replaced, inside checkpointed layers too.

    Returns ``(root, copies)`` as ``funcmeta._src.module.shadow.shadow`` does.
    """
    standins = standins or {}
    replace: dict[str, Callable[[nn.Module], nn.Module]] = {}
    copies: list[tuple[nn.Module, nn.Module]] = []
    for n in names:
        layer = module.get_submodule(n)
        inside = {relative(name, n): make for name, make in standins.items() if within(name, n)}
        inner, inner_copies = shadow(layer, inside)
        copies += inner_copies
        replace[n] = functools.partial(_Checkpointed, inner=inner, name=n)
    for name, make in standins.items():
        if not any(within(name, n) for n in names):
            replace[name] = make
    root, outer_copies = shadow(module, replace)
    return root, copies + outer_copies
