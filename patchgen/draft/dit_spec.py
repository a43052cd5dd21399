"""A drafted DiT spec: the tiny config by draft's DiT rule and the spec text (module, output, `[model]` with the
training shell as its class, `[model.data]` naming the condition model, then the recognised patches)."""

from __future__ import annotations

import ast
import re
import tomllib
from typing import Any

import libcst as cst

from patchgen.config import ProjectConfig
from patchgen.draft.recognised import Recognised
from patchgen.draft.render import _patch, _table, value
from patchgen.draft.structure import Module, dotted, nodes
from patchgen.upstream import UpstreamSource

CONDITIONS = "runtime/diffusion/conditions"

# Rule (docs/adding-a-model.md, `patchgen draft`): 2 blocks (1 double-stream + 1 single-stream where both exist),
# 4 heads of 16 (sp = 2 and 4 divide the heads; RoPE axes 4/6/6), 4 latent channels, text/condition widths 16-32,
# feed-forward 64; every other __init__ parameter keeps its default.
DIT_TINY: dict[str, Any] = {
    "num_layers": 2,
    "num_single_layers": 1,
    "num_attention_heads": 4,
    "attention_head_dim": 16,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 16,
    "freq_dim": 32,
    "ffn_dim": 64,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 24,
    "cross_attention_dim": 32,
    "caption_channels": 32,
    "axes_dims_rope": [4, 6, 6],
    "rope_max_seq_len": 64,
}


def dit_tiny(mod: Module, cls: str) -> dict[str, Any]:
    """The rule above applied to the parameters of `cls.__init__`."""
    init = mod.method(cls, "__init__")
    params = [p.name.value for p in init.params.params] if init is not None else []
    tiny = {k: v for k, v in DIT_TINY.items() if k in params}
    if "num_single_layers" in tiny:
        tiny["num_layers"] = 1
    if "guidance_embeds" in params and _guidance_builds(mod, cls):  # a patched path's input: on where it builds
        tiny["guidance_embeds"] = True
    return tiny


def _guidance_builds(mod: Module, cls: str) -> bool:
    """Whether `cls.__init__` builds its guidance embedding (`if guidance_embeds:` ...) with every argument its
    class requires: Bria's omits `time_theta`, so diffusers' class fails with it on, and draft leaves it off."""
    init = mod.method(cls, "__init__")
    for branch in nodes(init, lambda n: isinstance(n, cst.If) and dotted(n.test) == "guidance_embeds"):
        for call in nodes(branch.body, lambda n: isinstance(n, cst.Call) and dotted(n.func) in mod.classes):
            built = mod.method(dotted(call.func), "__init__")
            if built is None:
                continue
            required = [p.name.value for p in built.params.params[1:] if p.default is None]
            given = {a.keyword.value for a in call.args if a.keyword is not None}
            positional = sum(a.keyword is None for a in call.args)
            if any(name not in given for name in required[positional:]):
                return False
    return True


def dit_capabilities(mod: Module, cls: str) -> list[str]:
    """video: a 3D class; guidance: a guidance embedding; image_condition: an image-embedding input width."""
    init = mod.method(cls, "__init__")
    params = [p.name.value for p in init.params.params] if init is not None else []
    guidance = "guidance_embeds" in params and _guidance_builds(mod, cls)
    found = {"video": "3D" in cls, "guidance": guidance, "image_condition": "image_dim" in params}
    return [name for name, present in found.items() if present]


def dit_spec_text(
    found: Recognised, pin: str, tiny: dict[str, Any], capabilities: list[str], condition: tuple[str, str]
) -> str:
    """The whole DiT spec file, deterministic for one upstream release."""
    target = found.target
    stem = target.module.rsplit(".", 1)[1]
    lines = [
        f"# {target.cls}: drafted by `patchgen draft {target.cls}` from {pin} {found.upstream.relpath}.",
        "# Each patch's comment says what draft recognised upstream and where; edit by hand only what it could not.",
        f'module = "{target.module}"',
        f'output = "generated/{target.name}_dit/{stem}.py"',
        f"keep = {value([target.cls])}",
        "",
    ]
    for module, keep in found.companions:  # shared modules whose classes the patches redefine
        lines += ["[[companion]]", f'module = "{module}"', f"keep = {value(keep)}", ""]
    model = {
        "model_type": target.name,
        "class": f"{target.cls}ForTraining",
        "upstream": f"diffusers.{target.cls}",
        "family": "dit",
    }
    if capabilities:
        model["capabilities"] = capabilities
    lines += [*_table("model", model), ""]
    lines += ["# tiny random config by draft's DiT rule (docs/adding-a-model.md); fit it to the condition model's"]
    lines += [*_table("model.tiny", tiny), ""]
    lines += [f"# the frozen condition model: {condition[1]}"]
    lines += [*_table("model.data", {"condition_model_type": condition[0]}), ""]
    if found.unsupported:
        lines += ["# not recognised (draft never guesses): the runtime refuses these layouts quoting the reason"]
        lines += [*_table("model.unsupported", found.unsupported), ""]
    for patch in found.patches:
        lines += [*_patch(patch), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def forward_params(text: str, cls: str) -> tuple[str, ...] | None:
    """The parameters of `cls.forward` in a module's text (its inputs, as a condition model feeds them)."""
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "forward":
                    return tuple(a.arg for a in item.args.args[1:] + item.args.kwonlyargs)
    return None


def condition_model(
    project: ProjectConfig | None, source: UpstreamSource, cls: str, text: str, name: str
) -> tuple[str, str]:
    """(condition model type, where it comes from): the project's condition model of that name, else a shipped
    DiT's whose diffusers class takes latents of as many dims (SanaVideo's video latents are not Sana's images) and
    whose condition model feeds this class: every input it feeds is one of this class's, and this class takes no
    input the shipped class does not (ChronoEdit's are Wan's; Bria's are Flux's but for the kwargs dict's name),
    else the name, to write."""
    own = f"{CONDITIONS}/{name}.py"
    if project is None or (project.root / own).is_file():
        return name, own
    mine = _inputs(forward_params(text, cls))
    for path in sorted(p for p in project.specs_dir.glob("*.toml") if p.stem != name):  # not its own spec
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
        model = raw.get("model", {})
        other = str(model.get("upstream", "")).rsplit(".", 1)[-1]
        condition = model.get("data", {}).get("condition_model_type")
        feeder = project.root / CONDITIONS / f"{condition}.py"
        if model.get("family") != "dit" or "module" not in raw or not condition or not feeder.is_file():
            continue
        theirs = _inputs(forward_params(source.read(raw["module"]).text, other))
        fed = theirs & set(re.findall(r"[\"'](\w+)[\"']", feeder.read_text(encoding="utf-8")))
        if _latent_dims(other) == _latent_dims(cls) and fed and fed <= mine <= theirs:
            return condition, f"{CONDITIONS}/{condition}.py, {path.stem}'s: it feeds {other}.forward's inputs"
    return name, f"none yet: write {own} (docs/dit.md)"


def _inputs(params: tuple[str, ...] | None) -> set[str]:
    """The tensor inputs among a forward's parameters: not a kwargs dict, the return flag or ControlNet residuals
    (which no condition model feeds)."""
    return {p for p in params or () if not (p.endswith("_kwargs") or p == "return_dict" or "controlnet" in p)}


def _latent_dims(cls: str) -> str:
    """`2D` / `3D` of a diffusers class name (image or video latents), '' when it says neither."""
    return "3D" if "3D" in cls else "2D" if "2D" in cls else ""
