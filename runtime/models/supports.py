"""What a run may ask of a generated class: its layout and its config options against what the class declares.

patchgen derives each class's ``supports`` record from the patches it applied (``runtime.models.registry.Supports``).
A run is refused at start-up, in one line, when it asks for something the class does not declare:

- ``parallel.sp > 1`` without SP patches: every SP rank would run the whole model on the whole sequence and the
  data-parallel reduction would add the SP group's identical gradients (each one counted ``sp`` times);
- ``parallel.ring > 1`` without a ring patch (a DiT whose attention calls are not wrapped by ``dit/ring_attention``);
- ``parallel.ep > 1`` without an expert-parallel plan (``moe/ep_plan``);
- each of these lines ends with the reason the spec states for lacking it (``[model.unsupported]``), when it does;
- a config option that changes the computation where a patch replaced upstream's code (``OPTIONS``), unless the
  spec declares it handled (``[model] handles``): e.g. ``final_logit_softcapping``, which upstream applies between
  the LM head and the loss that ``loss/causal_lm_head`` replaces.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runtime.models.registry import GeneratedModel

__all__ = ["OPTIONS", "layout_problems", "option_problems", "set_options"]

# config option -> (under which layout the patched code path would not honour it, why). "any": whatever the layout.
OPTIONS: dict[str, tuple[str, str]] = {
    "final_logit_softcapping": ("any", "upstream caps the logits between the LM head and the loss that the "
                                "loss/causal_lm_head patch replaces"),
    "attn_logit_softcapping": ("ring", "ring attention computes a plain softmax (no logit softcap)"),
}  # fmt: skip


def _active(value: Any) -> bool:
    return value is not None and value is not False and value != 0


def set_options(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """The ``OPTIONS`` a config sets (nested sub-configs included, e.g. ``text_config``), by dotted key."""
    found: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            found.update(set_options(value, f"{prefix}{key}."))
        elif key in OPTIONS and _active(value):
            found[f"{prefix}{key}"] = value
    return found


def _stated(entry: GeneratedModel, capability: str) -> str:
    """The spec's own reason for lacking ``capability`` (``[model.unsupported]``), as the end of a refusal line."""
    reason = entry.supports.unsupported.get(capability)
    return f"; specs/{entry.spec}.toml states: {reason}" if reason else ""


def layout_problems(entry: GeneratedModel, sp: int, ring: int, ep: int) -> list[str]:
    """One line per layout dim the class does not declare; empty when it declares them all."""
    supports, spec = entry.supports, entry.spec
    found = []
    if sp > 1 and not supports.sp:
        found.append(
            f"parallel.sp: {sp} asks for sequence parallelism, but spec {spec!r} applies no SP patch "
            f"(sp/ulysses_attention, or dit/shard_tokens with its attention patches): each SP rank would run the "
            f"whole model and every gradient would be counted {sp} times; set parallel.sp: 1 or add the SP patches "
            f"to specs/{spec}.toml" + _stated(entry, "sp")
        )
    if ring > 1 and supports.sp and not supports.ring:
        found.append(
            f"parallel.ring: {ring} asks for ring attention, but spec {spec!r} wraps no attention call with it "
            f"(dit/ring_attention); set parallel.ring: 1 or add the patch to specs/{spec}.toml"
            + _stated(entry, "ring")
        )
    if ep > 1 and not supports.ep:
        found.append(
            f"parallel.ep: {ep} asks for expert parallelism, but spec {spec!r} has no expert-parallel plan "
            f"(moe/ep_plan); set parallel.ep: 1 or add the patch to specs/{spec}.toml" + _stated(entry, "ep")
        )
    return found


def option_problems(entry: GeneratedModel, values: Mapping[str, Any], ring: int, where: str) -> list[str]:
    """One line per computation-changing option ``values`` (the model's config, as ``where`` names it) sets that
    the class's patched code would not honour under this layout and its spec does not declare handled."""
    found = []
    for key, value in set_options(values).items():
        name = key.rsplit(".", 1)[-1]
        layout, why = OPTIONS[name]
        if name in entry.supports.handles or (layout == "ring" and ring <= 1):
            continue
        found.append(
            f"{where}: {key} = {value!r} is not honoured by spec {entry.spec!r}'s generated class ({why}); "
            f"handle it in the spec and declare it in [model] handles, or train a config without it"
            + ("" if layout == "any" else " or with parallel.ring: 1")
        )
    return found
