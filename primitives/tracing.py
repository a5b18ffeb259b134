"""Whether a call may be traced or transformed: then it must not read tensor values on the host
nor skip the dispatcher. The exported ops' eager path (``coda.export.autograd``) and the fused
loss's targets (``loss_targets``) both ask ``traced``."""

from __future__ import annotations

from collections.abc import Iterable

import torch

_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))
_dispatch_modes = torch._C._len_torch_dispatch_stack
# (a PyTorch without functorch transforms has none active)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def traced(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether something may be tracing or transforming a call on ``tensors`` — ``torch.compile``,
    fake or functional tensors (tensor subclasses), a dispatch mode (``opcheck``, ``make_fx``,
    FakeTensorMode), a ``torch.func`` transform (its wrapped tensors are of type ``Tensor``) — so
    it must go through the registered custom op rather than an eager ``autograd.Function``, and
    must not read values on the host."""
    return (
        torch.compiler.is_compiling()
        or not _PLAIN.issuperset(map(type, tensors))
        or _dispatch_modes() > 0  # what _get_current_dispatch_mode() reads
        or _functorch_active()
    )
