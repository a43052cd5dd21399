"""Checked attention sites: under a sharded layout every attention module must run through a patched site.

Slicing tokens over the SP group is only correct when *every* attention that mixes tokens runs the all-to-all (or
the ring). An attention module whose code was never patched attends to this rank's tokens only and trains wrong
numbers without an error. So, while SP is on, each attention module of the model is watched: a forward pre-hook
clears its count of site calls, the patched sites (the Ulysses / ring attention functions, ``vit_all_to_all``,
``attention_split``) call ``mark_site(module)``, and a forward hook raises on the first forward where a module
finished without one.

"The model's attention modules" does not come from the patches (that would check nothing): it is every leaf-most
module whose class name ends with ``Attention`` (transformers' convention) and every diffusers attention module
(``AttentionModuleMixin`` / ``Attention``), minus the module paths the spec declares as running before the token
split on replicated tokens only (``dit/shard_tokens``' ``replicated_modules``, recorded in the model record). Names
alone miss a mixer no name announces (a gated delta-net, a causal convolution): the start-up self-check finds the
model's sequence mixers by behaviour on its shrunk copy (``runtime/parallel/mixers.py``) and their classes are
watched too (``classes``). A torch layer that mixes (a ``Conv2d``: no code of the model's own) is watched through
the module that calls it, its parent, which the site helper marks when it is handed the layer
(``grid_halo_conv2d``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from runtime.config.errors import LayoutRefused
from runtime.parallel.mixers import layer_key

__all__ = ["attention_modules", "install_site_checks", "mark_site", "UnpatchedAttentionError"]

_COUNT = "_patchgen_site_calls"
_CALLER = "_patchgen_site_caller"  # on a watched torch layer's module: the parent whose count its site marks


class UnpatchedAttentionError(LayoutRefused):
    """An attention module ran under a sharded layout without passing through a checked site."""


def mark_site(module: Any) -> None:
    """Called by every patched attention site with the attention module it serves (None: not known, no mark); a
    torch layer marks the watched module that calls it."""
    if isinstance(module, nn.Module):
        module = module.__dict__.get(_CALLER, module)
        if _COUNT in module.__dict__:
            module.__dict__[_COUNT] += 1


def _is_attention(module: nn.Module) -> bool:
    if type(module).__name__.endswith("Attention"):
        return True
    try:
        from diffusers.models.attention import AttentionModuleMixin
        from diffusers.models.attention_processor import Attention
    except ImportError:  # a text-only install: no diffusers attention modules exist
        return False
    return isinstance(module, (AttentionModuleMixin, Attention))


def attention_modules(
    model: nn.Module, exempt: Iterable[str] = (), classes: Iterable[str] = ()
) -> list[tuple[str, nn.Module]]:
    """The leaf-most attention modules of ``model`` with their paths, and those of the census's ``classes``
    (``runtime.parallel.mixers.census``: a torch layer's caller in its place), those under an ``exempt`` path left
    out."""
    exempt, classes = tuple(exempt), frozenset(classes)
    found = [(name, m) for name, m in model.named_modules() if _is_attention(m) or type(m).__name__ in classes]
    for name, module in model.named_modules():
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name) if name else None
        if parent is not None and layer_key(parent, attribute) in classes:
            module.__dict__[_CALLER] = parent
            if all(m is not parent for _, m in found):
                found.append((parent_name, parent))
    paths = [name for name, _ in found]
    leaves = []
    for name, module in found:
        if any(other.startswith(name + ".") for other in paths):
            continue  # a container of attention modules (e.g. a block named *Attention): its children are watched
        if any(name == p or name.startswith(p + ".") for p in exempt):
            continue
        leaves.append((name, module))
    return leaves


def install_site_checks(
    model: nn.Module, layout: str, exempt: Iterable[str] = (), spec: str = "?", classes: Iterable[str] = ()
) -> list[Any]:
    """Watch every attention module of ``model`` and every module of the ``classes`` (see the module docstring; one
    already watched is left as it is); returns the hook handles.

    ``layout`` names the sharded layout in the error (e.g. ``parallel.sp = 2``), ``spec`` the model's spec.
    """
    handles = []
    for name, module in attention_modules(model, exempt, classes):
        if _COUNT in module.__dict__:
            continue
        module.__dict__[_COUNT] = 0

        def before(mod: nn.Module, args: Any) -> None:
            mod.__dict__[_COUNT] = 0

        def after(mod: nn.Module, args: Any, output: Any, name: str = name) -> None:
            if mod.__dict__.get(_COUNT, 1) == 0:
                raise UnpatchedAttentionError(
                    f"{name} ({type(mod).__name__}) ran under {layout} without passing through a patched attention "
                    f"site: it mixed this rank's tokens only, which trains wrong numbers. Patch its attention "
                    f"call in spec {spec!r} (sp/ulysses_attention, sp/vit_attention_all_to_all, "
                    f"sp/linear_attention_heads or dit/ulysses_to_heads), declare it in dit/shard_tokens' "
                    f"replicated_modules if it runs before the token split, or train with parallel.sp: 1"
                )

        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after))
    return handles
