"""The fence around torch's private internals: every access funcmeta makes to a name torch
does not promise to keep is in this package, wrapped once, and nowhere else. One module per
torch subsystem (:mod:`.functorch`, :mod:`.autograd`, :mod:`.backends`, :mod:`.modules`,
:mod:`.inductor`, :mod:`.remat`, :mod:`.pytree`, and :mod:`.frames` for Python's own); the package
re-exports them all, and code elsewhere imports from the package.

Each access is registered in one registry, :data:`ACCESSES`, with a probe that says whether this torch
release has it; ``tests/core/test_torch_version.py`` runs every probe on every torch the suite runs
on and fails with the torch version and the missing name. What each is for:

- **functorch's batching primitives** (``torch._C._functorch``): stepping in and out of a
  ``vmap`` level, wrapping and unwrapping batched tensors. Task batching's fast layers and
  checkpointed layers under ``vmap`` need them (``_src/batching``).
- **torch's pytree registry** (``torch.utils._cxx_pytree`` or ``torch.utils._pytree``):
  flattening outputs of registered types (HuggingFace ``ModelOutput``).
- **attention kernel flags** (``torch._C._get/_set_*_sdp_*``) and the multi-head attention
  fast-path flag (``torch.backends.mha._is_fastpath_enabled``): choosing twice-differentiable
  kernels and putting the user's choice back (:mod:`funcmeta.checkpoint.kernels`).
- **``nn.Module`` internals**: its ``_parameters``, ``_buffers`` and ``_modules`` dicts
  (shadow module trees share them; :class:`funcmeta.FunctionalModel` swaps tensors in
  them), its hook dictionaries (does a call run hooks?), and a convolution's
  ``_conv_forward`` and ``_reversed_padding_repeated_twice``.
- **``torch.utils.checkpoint.checkpoint``'s code**: while funcmeta runs a model or
  recomputes a layer, calls of ``torch.utils.checkpoint.checkpoint`` (however the caller
  imported it: HuggingFace binds it in a ``functools.partial``) reach funcmeta's dispatcher
  instead (``funcmeta._src.checkpoint.takeover``); the function's code is swapped for a trampoline
  and put back when the last such block ends. Calls from other threads, or outside those
  blocks, run torch's own code.
- **vmap's refusals**: which ``RuntimeError`` texts mean "vmap cannot batch this" (torch has
  no exception type for it), checked against a real refusal by the test suite.
- **AOTAutograd's rematerialization pass** (``torch._functorch._activation_checkpointing``):
  the compiled step wraps it while compiling, to tag its inner steps' operations for
  recomputation first (:mod:`.remat`); an optional access, like dynamo's
  ``trace_autograd_ops`` (:mod:`.inductor`).

An access that a capability needs is named with it in ``funcmeta._src.core.capabilities``:
where its probe says no, that capability refuses (on torch 2.5 to 2.7, the query of the
saved-tensor hooks in force, for ``checkpoint_steps``).

Example:
    >>> from funcmeta._src.core.fence import ACCESSES, missing_accesses
    >>> "torch._C._autograd._top_saved_tensors_default_hooks" in ACCESSES
    True
    >>> set(missing_accesses()) <= set(ACCESSES)
    True
"""

from __future__ import annotations

from funcmeta._src.core.fence.autograd import (
    AutocastState,
    autocast_enabled,
    checkpoint_redirected,
    dispatch_checkpoint,
    original_checkpoint,
    saved_hooks_in_force,
    saved_tensor_hooks_state,
    set_checkpoint_dispatch,
    set_saved_tensor_hooks_state,
    tensor_version,
)
from funcmeta._src.core.fence.backends import (
    cudnn_disabled,
    fused_rnn,
    get_fast_path,
    sdp_backends,
    sdp_getters,
    sdp_priority,
    sdp_setters,
    set_fast_path,
    set_sdp_priority,
)
from funcmeta._src.core.fence.frames import (
    caller_frame,
    frame_executes,
    frame_local,
    user_stacklevel,
)
from funcmeta._src.core.fence.functorch import (
    FUNCTORCH,
    add_batch_dim,
    inside_transform,
    is_batchedtensor,
    is_vmap_refusal,
    maybe_get_level,
    missing_functorch,
    pack_padded_op,
    pad_packed_op,
    peek_interpreter_stack,
    pop_dynamic_layer_stack,
    prepare_vmap,
    push_dynamic_layer_stack,
    remove_batch_dim,
    unwrap_batched,
    vmap_decrement_nesting,
    vmap_increment_nesting,
)
from funcmeta._src.core.fence.inductor import (
    UNNAMED_CUDAGRAPH_SKIP,
    autograd_tracing,
    backward_region,
    can_mark_backward,
    compiling,
    cudagraph_skips,
    inductor_aten_max_pool_backward,
    inductor_graph_pass,
    inductor_has_option,
    inductor_mode_options,
    probe_cpu_vector_isa,
    with_own_code_object,
)
from funcmeta._src.core.fence.modules import (
    buffer_dict,
    conv_forward,
    conv_padding,
    has_hooks,
    module_dict,
    parameter_dict,
    qkv_same_embed_dim,
    reparametrized,
    set_module_dict,
    share_dicts,
    take_attributes,
    traceback_modules,
    write_back_attributes,
)
from funcmeta._src.core.fence.pytree import (
    torch_pytree,
)
from funcmeta._src.core.fence.registry import (
    ACCESSES,
    missing_accesses,
)
from funcmeta._src.core.fence.remat import (
    INNER_STEP_KEY,
    RematMode,
    can_recompute_inner_gradients,
    inner_step_region,
    recompute_inner_gradients,
    remat_cache_tag,
    tag_inner_steps,
)

__all__ = [
    "ACCESSES",
    "AutocastState",
    "FUNCTORCH",
    "INNER_STEP_KEY",
    "RematMode",
    "UNNAMED_CUDAGRAPH_SKIP",
    "add_batch_dim",
    "autocast_enabled",
    "autograd_tracing",
    "backward_region",
    "buffer_dict",
    "caller_frame",
    "can_mark_backward",
    "can_recompute_inner_gradients",
    "checkpoint_redirected",
    "compiling",
    "conv_forward",
    "conv_padding",
    "cudagraph_skips",
    "cudnn_disabled",
    "dispatch_checkpoint",
    "frame_executes",
    "frame_local",
    "fused_rnn",
    "get_fast_path",
    "has_hooks",
    "inductor_aten_max_pool_backward",
    "inductor_graph_pass",
    "inductor_has_option",
    "inductor_mode_options",
    "probe_cpu_vector_isa",
    "inner_step_region",
    "inside_transform",
    "is_batchedtensor",
    "is_vmap_refusal",
    "maybe_get_level",
    "missing_accesses",
    "missing_functorch",
    "module_dict",
    "original_checkpoint",
    "pack_padded_op",
    "pad_packed_op",
    "parameter_dict",
    "peek_interpreter_stack",
    "pop_dynamic_layer_stack",
    "prepare_vmap",
    "push_dynamic_layer_stack",
    "qkv_same_embed_dim",
    "recompute_inner_gradients",
    "remat_cache_tag",
    "remove_batch_dim",
    "reparametrized",
    "saved_hooks_in_force",
    "saved_tensor_hooks_state",
    "sdp_backends",
    "sdp_getters",
    "sdp_priority",
    "sdp_setters",
    "set_checkpoint_dispatch",
    "set_fast_path",
    "set_module_dict",
    "set_saved_tensor_hooks_state",
    "set_sdp_priority",
    "share_dicts",
    "tag_inner_steps",
    "take_attributes",
    "tensor_version",
    "torch_pytree",
    "traceback_modules",
    "unwrap_batched",
    "user_stacklevel",
    "vmap_decrement_nesting",
    "vmap_increment_nesting",
    "with_own_code_object",
    "write_back_attributes",
]
