"""What `patchgen draft <name>` names: a transformers model type (or its causal-LM class), read from the pinned
release's own auto mappings as text (no import: importing transformers imports torch), or a refusal in one line."""

from __future__ import annotations

import ast
import difflib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from patchgen.errors import PatchgenError
from patchgen.upstream import UpstreamSource

AUTO_MAPPINGS = "transformers.models.auto.auto_mappings"
MODELING_AUTO = "transformers.models.auto.modeling_auto"
CAUSAL_LM_MAPPING = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
VLM_MAPPING = "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"
DIT_PACKAGE = "diffusers.models.transformers."


@dataclass(frozen=True)
class Target:
    """A transformers decoder LM draft can read: its model type, modeling module, causal-LM and config classes."""

    model_type: str
    name: str  # the spec's name: the module folder, or the model type where it names a sub-model of the folder
    module: str
    config_module: str
    causal_lm: str  # the class trained: a *ForCausalLM, or a VLM's *ForConditionalGeneration
    family: str = "causal_lm"


@dataclass(frozen=True)
class DitTarget:
    """A diffusers transformer draft can read: its class, module, and the spec name (`<name>_dit` output folder)."""

    cls: str
    module: str
    name: str

    @property
    def model_type(self) -> str:
        return self.name


def literal_mapping(text: str, variable: str) -> dict[str, str]:
    """`NAME = OrderedDict([(key, value), ...])` of an upstream module, read from its text."""
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == variable for t in node.targets):
            call = node.value
            if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.List):
                pairs = [ast.literal_eval(item) for item in call.args[0].elts if isinstance(item, ast.Tuple)]
                return {k: v for k, v in pairs if isinstance(k, str) and isinstance(v, str)}
    return {}


def resolve(argument: str, source: UpstreamSource, pins: dict[str, str]) -> Target | DitTarget:
    """The decoder LM (a model type or its causal-LM class) or the diffusers transformer class `argument`
    names; PatchgenError (one line, exit 2) for anything draft cannot read."""
    if "." in argument or "/" in argument:
        package = re.split(r"[./]", argument)[0]
        if package not in pins:
            raise PatchgenError(
                f"draft {argument!r}: {package!r} is outside the pinned packages ({', '.join(sorted(pins))}); draft "
                f"reads only a pinned upstream release: name a transformers model type (e.g. llama)"
            )
        raise PatchgenError(
            f"draft {argument!r}: name the model type (e.g. llama), not a module path; draft finds the module itself"
        )
    mappings = source.read(AUTO_MAPPINGS).text
    configs = literal_mapping(mappings, "CONFIG_MAPPING_NAMES")
    special = literal_mapping(mappings, "SPECIAL_MODEL_TYPE_TO_MODULE_NAME")
    causal = literal_mapping(source.read(MODELING_AUTO).text, CAUSAL_LM_MAPPING)
    if argument[:1].isupper():
        by_class = {cls: model_type for model_type, cls in causal.items()}
        if argument not in by_class:
            where = _diffusers_class(argument, source) if "diffusers" in pins else None
            if where is not None and where.startswith(DIT_PACKAGE):
                return DitTarget(argument, where, _dit_name(where))
            raise PatchgenError(_not_a_decoder_class(argument, causal, pins, source))
        argument = by_class[argument]
    if argument not in configs:
        near = difflib.get_close_matches(argument, list(configs), n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(near)}?" if near else "see transformers' CONFIG_MAPPING_NAMES"
        raise PatchgenError(
            f"draft {argument!r}: not a model type of transformers=={source.version('transformers')}; {hint}"
        )
    folder = special.get(argument, argument.replace("-", "_"))
    base = f"transformers.models.{folder}"
    name = _spec_name(argument, folder)
    vlm = literal_mapping(source.read(MODELING_AUTO).text, VLM_MAPPING).get(argument)
    if argument not in causal and vlm is not None:  # drafted as a member of a shipped VLM family (family.py)
        return Target(argument, name, f"{base}.modeling_{folder}", f"{base}.configuration_{folder}", vlm, "vlm")
    if argument not in causal:
        raise PatchgenError(
            f"draft {argument!r}: transformers has no causal-LM class for it (not in {CAUSAL_LM_MAPPING}); draft "
            f"recognises decoder LMs so far: write a VLM, omni or encoder spec by hand (docs/adding-a-model.md)"
        )
    return Target(argument, name, f"{base}.modeling_{folder}", f"{base}.configuration_{folder}", causal[argument])


def _spec_name(model_type: str, folder: str) -> str:
    """The module folder where the model type only spells it otherwise (`xlm-roberta`, `kosmos-2`); the model type
    where it names one model of a folder that holds several (`llama4_text` of llama4, whose `llama4` is the VLM):
    two models of one folder must not share a spec."""
    if model_type.replace("-", "").replace("_", "") == folder.replace("_", ""):
        return folder
    return model_type.replace("-", "_")


def _dit_name(module: str) -> str:
    """The spec name of a DiT: its module's name less `transformer` and `2d` / `3d` (transformer_wan -> wan,
    sana_transformer -> sana, cogvideox_transformer_3d -> cogvideox)."""
    parts = [p for p in module.rsplit(".", 1)[1].split("_") if p not in ("transformer", "2d", "3d")]
    return "_".join(parts)


def _not_a_decoder_class(name: str, causal: dict[str, str], pins: dict[str, str], source: UpstreamSource) -> str:
    """The one line for a class name that is no transformers causal-LM class: a diffusers class (a DiT draft is not
    written yet; anything else is not a transformer), or an unknown name with the nearest causal-LM classes."""
    where = _diffusers_class(name, source) if "diffusers" in pins else None
    if where is not None:
        return (
            f"draft {name!r}: {where}.{name} is not a transformer (draft reads decoder LMs and the classes of "
            f"{DIT_PACKAGE.rstrip('.')}); nothing to draft"
        )
    near = difflib.get_close_matches(name, list(causal.values()), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(near)}?" if near else "name a model type, e.g. llama"
    return f"draft {name!r}: not a causal-LM class of the pinned transformers nor a diffusers class; {hint}"


def _diffusers_class(name: str, source: UpstreamSource) -> str | None:
    """The module of the installed (pinned) diffusers that defines class `name`, found by reading its models/."""
    source.version("diffusers")  # the pinned release, or a one-line refusal
    found = importlib.util.find_spec("diffusers")
    if found is None or not found.submodule_search_locations:
        return None
    root = Path(list(found.submodule_search_locations)[0])
    pattern = re.compile(rf"^class {re.escape(name)}\b", re.MULTILINE)
    for path in sorted((root / "models").rglob("*.py")):
        if pattern.search(path.read_text(encoding="utf-8", errors="replace")):
            return "diffusers." + path.relative_to(root).with_suffix("").as_posix().replace("/", ".")
    return None
