"""The special-token ids an export records, so that plain ``generate`` stops where the trained model ends a reply.

``generate`` stops at ``generation_config.eos_token_id``, read from ``generation_config.json`` or else from the
model config; a random-init config names no token, so an export without them generates up to ``max_new_tokens``.
The ids come from the tokenizer the run trained with: its bos/eos/pad, and the end-of-turn token its chat template
closes a reply with (Qwen ``<|im_end|>``, Llama 3 ``<|eot_id|>``). Both the end-of-turn token and the eos stop
generation, end-of-turn first, as Qwen's published chat checkpoints list them (``generation_config.json``:
``eos_token_id: [<|im_end|>, <|endoftext|>]``, ``pad_token_id: <|endoftext|>``; ``config.json``: the tokenizer's
bos and eos).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

# A reply whose text cannot merge with what the template appends after it (the end-of-turn token is special).
_PROBE_REPLY = "patchgen probe reply."
_PROBE = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": _PROBE_REPLY}]


def text_tokenizer(tokenizer: Any) -> Any:
    """The text tokenizer of a tokenizer, a processor (its ``.tokenizer``) or a tokenizer/processor directory."""
    if isinstance(tokenizer, str | Path):
        from transformers import AutoTokenizer

        directory = Path(tokenizer)
        loaded = AutoTokenizer.from_pretrained(str(directory))
        template = directory / "chat_template.json"  # a processor's template (older layout), not the tokenizer's
        if loaded.chat_template is None and template.is_file():
            loaded.chat_template = json.loads(template.read_text(encoding="utf-8")).get("chat_template")
        return loaded
    return getattr(tokenizer, "tokenizer", tokenizer)


def end_of_turn_id(tokenizer: Any, template_owner: Any | None = None) -> int | None:
    """The special token the chat template puts right after an assistant reply, or None (no template, or the reply
    is followed by ordinary text). ``template_owner`` (a processor) renders instead of the tokenizer when given."""
    owner = template_owner if getattr(template_owner, "chat_template", None) else tokenizer
    if not getattr(owner, "chat_template", None):
        return None
    try:
        rendered = owner.apply_chat_template(_PROBE, tokenize=False)
    except Exception:  # a template that cannot render this probe (e.g. it insists on a system turn): no id from it
        return None
    if not isinstance(rendered, str) or _PROBE_REPLY not in rendered:
        return None
    after = rendered[rendered.rindex(_PROBE_REPLY) + len(_PROBE_REPLY) :]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    if not ids:
        return None
    added = getattr(tokenizer, "added_tokens_decoder", {}).get(ids[0])
    return ids[0] if added is not None and added.special else None


def _valid(token_id: Any, size: int) -> int | None:
    return token_id if isinstance(token_id, int) and 0 <= token_id < size else None


def special_token_ids(tokenizer: Any) -> dict[str, Any]:
    """``bos_token_id``, ``eos_token_id`` (the tokenizer's eos) and ``pad_token_id`` of ``tokenizer`` (a tokenizer,
    processor or directory), plus ``stop_token_ids``: the end-of-turn token (if any) and the eos, in that order."""
    template_owner = None if isinstance(tokenizer, str | Path) else tokenizer
    tok = text_tokenizer(tokenizer)
    eot = end_of_turn_id(tok, template_owner)
    stops = [i for i in dict.fromkeys((eot, tok.eos_token_id)) if i is not None]
    return {
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "stop_token_ids": stops,
        "vocab": len(tok),
    }


def set_config_token_ids(config: PretrainedConfig, ids: dict[str, Any]) -> None:
    """Write the tokenizer's bos/eos/pad into ``config`` (and its text config) where the config class has the key.

    A value the tokenizer does not define keeps the config's own, unless that one is no token of this tokenizer
    (a random-init config's defaults are the upstream checkpoint's ids, e.g. 151645 for a 512-token vocabulary).
    """
    targets = [config]
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if text is not config:
        targets.append(text)
    for target in targets:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if key in target.to_dict():
                value = ids[key] if ids[key] is not None else _valid(getattr(target, key, None), ids["vocab"])
                setattr(target, key, value)


def export_generation_config(model: PreTrainedModel, config: PretrainedConfig, ids: dict[str, Any] | None) -> Any:
    """The ``GenerationConfig`` to save beside the weights: the model's own (a pretrained checkpoint's sampling
    defaults are kept) with the tokenizer's stop, bos and pad ids (pad falls back to the eos, as Qwen's do)."""
    from transformers import GenerationConfig

    base = getattr(model, "generation_config", None)
    generation = (
        copy.deepcopy(base) if isinstance(base, GenerationConfig) else GenerationConfig.from_model_config(config)
    )
    # the exported config's cache setting (export_config restored it), not the one training ran with
    generation.use_cache = getattr(config.get_text_config(), "use_cache", True)
    if ids is None:
        return generation
    stops = ids["stop_token_ids"]
    generation.eos_token_id = (stops[0] if len(stops) == 1 else stops) if stops else None
    bos = ids["bos_token_id"]
    generation.bos_token_id = bos if bos is not None else _valid(generation.bos_token_id, ids["vocab"])
    generation.pad_token_id = ids["pad_token_id"] if ids["pad_token_id"] is not None else ids["eos_token_id"]
    return generation
