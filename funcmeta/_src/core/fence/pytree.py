"""torch's pytree registry (``torch.utils._cxx_pytree`` or ``torch.utils._pytree``):
flattening outputs of registered types (HuggingFace ``ModelOutput``)."""

from __future__ import annotations

from funcmeta._src.core.fence.registry import ACCESSES

__all__ = ["torch_pytree"]

try:  # torch's registry on optree: registered types (HuggingFace ModelOutput), fast
    import torch.utils._cxx_pytree as torch_pytree
except ImportError:  # pragma: no cover - depends on the torch and optree releases
    import torch.utils._pytree as torch_pytree  # type: ignore[no-redef]

ACCESSES["torch.utils._cxx_pytree or torch.utils._pytree"] = lambda: hasattr(
    torch_pytree, "tree_flatten"
)
