"""The class a module had before FSDP2 sharded it: ``fully_shard`` swaps a module's class for a generated
``FSDP<Name>(FSDPModule, Name)`` in place, and code that tells modules apart by class (block names in
``_no_split_modules``, errors naming a model) must see ``Name``."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["unsharded_class"]


def unsharded_class(module: nn.Module) -> type:
    """``module``'s class, or the class FSDP2's generated subclass wraps."""
    cls = type(module)
    if cls.__bases__[0] is FSDPModule and len(cls.__bases__) == 2:
        return cls.__bases__[1]
    return cls
