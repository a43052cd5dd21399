"""Checked sites at generation time: every attention processor a DiT's token split accepts has its Ulysses site.

`dit/shard_tokens` lists the processor classes that may run under SP (`processors`); the runtime refuses any other.
A listed class the spec never patched with `dit/ulysses_to_heads` would pass that test and attend to this rank's
tokens only: training wrong numbers with exit 0. So regen refuses it, naming the class and the patches to add.
"""

from __future__ import annotations

from patchgen.errors import PatchgenError
from patchgen.spec import Spec

SHARD = "dit/shard_tokens"
TO_HEADS = "dit/ulysses_to_heads"
# sites that are exact on this rank's tokens without the all-to-all: linear attention's all-reduced key-value sums,
# and a cross-attention whose queries are this rank's tokens and whose keys and values are replicated
OTHER_SITES = ("dit/linear_attention_kv", "dit/local_attention")


def check_processor_sites(spec: Spec) -> None:
    """Raise PatchgenError for the first listed processor without an attention-site patch (`dit/ulysses_to_heads`,
    or a site exact on local tokens) of its `__call__`."""
    sites = {p.scope for p in spec.patches if p.template.name in (TO_HEADS, *OTHER_SITES)}
    for patch in spec.patches:
        if patch.template.name != SHARD:
            continue
        for cls in patch.vars.get("processors", []):
            if f"{cls}.__call__" not in sites:
                raise PatchgenError(
                    f"{spec.path}: {patch.label}: vars.processors lists {cls!r}, but no {TO_HEADS} (or "
                    f"{' / '.join(OTHER_SITES)}) patch has scope '{cls}.__call__': under SP that processor would "
                    f"attend to this rank's tokens only (wrong numbers, no error). Add {TO_HEADS} and "
                    f"dit/ulysses_to_sequence patches for {cls}.__call__, or "
                    f"drop {cls} from processors"
                )
