"""Drafting a member of a shipped family: a transformers VLM whose modeling module is a shipped VLM spec's with other
class names (Qwen3-VL-MoE is Qwen3-VL's module, `Qwen3VL` -> `Qwen3VLMoe`, plus MoE layers). The draft `extends`
that spec with the class prefix renamed, and adds what the LM recogniser finds in the new module (the load-balancing
loss, the stacked experts). A family member is proven by generation (every inherited anchor matches once in the
renamed scopes); a model with no such relative is refused in one line, never guessed."""

from __future__ import annotations

import re
import tomllib
from typing import Any

from patchgen.config import ProjectConfig
from patchgen.cst.prune import parsed, reachable_definitions
from patchgen.draft.lm_moe import moe
from patchgen.draft.loading import load_drafted
from patchgen.draft.names import Target
from patchgen.draft.recognised import Recognised
from patchgen.draft.render import _patch, _table, value
from patchgen.draft.structure import Module
from patchgen.draft.tiny import AUX_VALUES, EXPERT_COUNTS, MOE_VALUES, config_fields
from patchgen.errors import PatchgenError
from patchgen.upstream import UpstreamSource

CONVERSIONS = "transformers.conversion_mapping"
TRANSPOSED_WIDTH = 48  # 2 * 48 and 48 both differ from the hidden size 64


def _prefixes(shipped: str, cls: str) -> tuple[str, str] | None:
    """(`Qwen3VL`, `Qwen3VLMoe`) for Qwen3VLForConditionalGeneration / Qwen3VLMoeForConditionalGeneration: the
    class names less their longest common suffix that starts with an upper-case letter."""
    n = 0
    while n < min(len(shipped), len(cls)) and shipped[-1 - n] == cls[-1 - n]:
        n += 1
    while n and not shipped[-n].isupper():
        n -= 1
    if not n or n == len(shipped) or n == len(cls):
        return None
    return shipped[:-n], cls[:-n]


def draft_member(target: Target, source: UpstreamSource, project: ProjectConfig) -> tuple[Recognised, str]:
    """(what was recognised, the spec text) for the VLM `target` names (its class in `target.causal_lm`)."""
    from patchgen.generate import generate  # the engine's heavy half, loaded only to prove a member's draft

    cls = target.causal_lm
    upstream = source.read(target.module)
    tried = []
    for path in sorted(project.specs_dir.glob("*.toml")):
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
        model = raw.get("model", {})
        if model.get("family") != "vlm" or "extends" in raw or path.stem == target.name:
            continue
        names = _prefixes(model.get("class", ""), cls)
        if names is None:
            continue
        found = _found(target, cls, upstream)
        text = _text(target, cls, path.stem, names, model, found, upstream.pin, source)
        spec = load_drafted(project, target.name, text)
        try:
            generate(spec, source, project)
        except PatchgenError:  # an inherited anchor that does not match: no member of that family
            tried.append(path.stem)
            continue
        return found, text
    raise PatchgenError(
        f"draft {target.model_type!r}: a VLM ({cls}) whose module is no shipped VLM spec's with other class names "
        f"({'tried ' + ', '.join(tried) if tried else 'no shipped VLM class of its shape'}: inherited anchors do not "
        f"match); write it by hand (docs/adding-a-model.md)"
    )


def _found(target: Target, cls: str, upstream) -> Recognised:
    """The MoE structures of the new module (in the VLM's text model)."""
    mod = Module(upstream)
    found = Recognised(target, upstream)
    reachable = reachable_definitions(parsed(upstream.text, upstream.relpath), [cls])
    pretrained = next((c for c in sorted(reachable) if c.endswith("PreTrainedModel") and c in mod.classes), None)
    # the text model is built through AutoModel.from_config(config.text_config): the one class that holds `layers`
    text_models = [c for c in mod.classes if any(a == "layers" for a, _ in mod.built(c))]
    if pretrained is not None and len(text_models) == 1:
        moe(mod, cls, text_models[0], pretrained, found)
    return found


def _text(
    target: Target,
    cls: str,
    base: str,
    names: tuple[str, str],
    model: dict[str, Any],
    found: Recognised,
    pin: str,
    source: UpstreamSource,
) -> str:
    capabilities = list(model.get("capabilities", []))
    if found.facts.get("moe") and "moe" not in capabilities:
        capabilities.append("moe")
    lines = [
        f"# {cls}: drafted by `patchgen draft {target.model_type}` from {pin} {found.upstream.relpath}: the module of",
        f"# specs/{base}.toml with {names[0]} -> {names[1]}; own patches below say what draft recognised and where.",
        f'extends = "{base}"',
        f"class_prefix = {value({'from': names[0], 'to': names[1]})}",
        f'module = "{target.module}"',
        f'output = "generated/{target.name}/{target.module.rsplit(".", 1)[1]}.py"',
        "",
        *_table("model", {"model_type": target.model_type, "capabilities": capabilities}),
        "",
    ]
    transposed = shape_decided_transpose(source.read(CONVERSIONS).text, target.model_type)
    text_tiny = _moe_tiny(found, source.read(target.config_module).text, f"{target.model_type}_text", transposed)
    if text_tiny:
        lines += ["# the inherited tiny config plus draft's MoE rule (docs/adding-a-model.md) on the text config"]
        lines += [*_table("model.tiny.text_config", text_tiny), ""]
    if found.unsupported:
        lines += ["# not recognised (draft never guesses): the runtime refuses these layouts quoting the reason"]
        lines += [*_table("model.unsupported", found.unsupported), ""]
    for patch in found.patches:
        lines += [*_patch(patch), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _moe_tiny(found: Recognised, config_text: str, text_type: str, transposed: bool) -> dict[str, Any]:
    """draft's MoE rule (patchgen/draft/tiny.py) on the fields of the text config class; `transposed`: transformers
    transposes released expert weights where their shape says so, so no expert matrix may be square."""
    if not found.facts.get("moe"):
        return {}
    fields = config_fields(config_text, text_type)
    tiny: dict[str, Any] = {}
    count = next((k for k in EXPERT_COUNTS if k in fields), None)
    if count is not None:
        tiny[count] = 8
    tiny.update({k: v for k, v in MOE_VALUES.items() if k in fields or k == "num_experts_per_tok"})
    if transposed and "moe_intermediate_size" in tiny:
        tiny["moe_intermediate_size"] = TRANSPOSED_WIDTH
    if found.facts.get("aux_loss"):
        tiny.update({k: v for k, v in AUX_VALUES.items() if k in fields})
    return tiny


def shape_decided_transpose(conversions: str, model_type: str) -> bool:
    """Whether transformers' checkpoint conversions for `model_type` transpose its experts where the shape says so
    (`Transpose(..., check_dims=True)`, qwen3_vl_moe): then (E, H, 2I) and (E, 2I, H) must differ, 2I != H."""
    match = re.search(rf'\n\s+"{re.escape(model_type)}": \[(.*?)\n\s+\],', conversions, re.DOTALL)
    return match is not None and "check_dims=True" in match.group(1)
