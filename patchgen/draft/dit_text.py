"""A DiT's text refiner: a module the forward runs on the text stream right after the patch embedding and that runs
attention of its own (HunyuanVideo's `context_embedder`, a token refiner). It runs before the split, on the whole
text on every rank, so the split is placed after it and its attention keeps upstream's processor
(`replicated_modules`)."""

from __future__ import annotations

import libcst as cst

from patchgen.draft.dit_layout import assign_of, self_call
from patchgen.draft.dit_processors import TEXT
from patchgen.draft.structure import Module, dotted, nodes


def _runs_attention(mod: Module, cls: str, processors: list[str]) -> bool:
    """Whether `cls` or a module it builds (transitively) builds an attention module (`...Attention(...)`, not a
    class of this module) whose processor is none of the model's SP-aware `processors`."""
    for one in [cls, *mod.paths(cls)]:
        for call in nodes(mod.method(one, "__init__"), lambda n: isinstance(n, cst.Call)):
            name = dotted(call.func) or ""
            if not name.endswith("Attention") or name in mod.classes:
                continue
            given = [a.value for a in call.args if a.keyword is not None and a.keyword.value == "processor"]
            if not given or not isinstance(given[0], cst.Call) or dotted(given[0].func) not in processors:
                return True
    return False


def text_refiners(
    mod: Module, cls: str, body: list[cst.CSTNode], end: int, processors: list[str]
) -> tuple[int, list[str]]:
    """(the last statement of the embedding run, the refiners in it): `end` extended over the statements right after
    it that assign the text stream from a module of `cls` running attention of its own."""
    built = dict(mod.built(cls))
    refiners = []
    while end + 1 < len(body):
        name, value = assign_of(body[end + 1])
        attr = self_call(value)
        if not (name or "").startswith(TEXT) or attr not in built or not _runs_attention(mod, built[attr], processors):
            break
        refiners.append(attr)
        end += 1
    return end, refiners
