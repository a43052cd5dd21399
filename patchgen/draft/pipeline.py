"""The draft pipeline: argument -> recognised structures -> tiny config -> spec text; loading a draft as the spec it
would be, proving it generates, and diffing it against a committed spec (`--check`)."""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
from dataclasses import dataclass

import typer

from patchgen.config import ProjectConfig
from patchgen.draft.dit import recognise_dit
from patchgen.draft.dit_spec import condition_model, dit_capabilities, dit_spec_text, dit_tiny
from patchgen.draft.family import draft_member
from patchgen.draft.lm import recognise
from patchgen.draft.names import DitTarget, Target, resolve
from patchgen.draft.recognised import Recognised
from patchgen.draft.render import spec_text
from patchgen.draft.structure import Module
from patchgen.draft.tiny import config_fields, tiny_config
from patchgen.errors import PatchgenError
from patchgen.spec import Spec
from patchgen.upstream import UpstreamSource

DIT_MODULES = "diffusers.models.transformers."  # where diffusers keeps its transformer classes


@dataclass(frozen=True)
class Drafted:
    target: Target | DitTarget
    found: Recognised
    text: str


def draft_spec(
    argument: str,
    source: UpstreamSource,
    pins: dict[str, str],
    name: str | None = None,
    project: ProjectConfig | None = None,
) -> Drafted:
    """The spec text for the decoder LM (a model type or its causal-LM class) or the diffusers transformer class
    `argument` names; `name` overrides a DiT's spec name (default: its module's, `transformer_wan` -> wan);
    `project`: where a DiT's condition model is looked for (none: the DiT's own name)."""
    target = resolve(argument, source, pins)
    if isinstance(target, Target) and target.family == "vlm":
        if project is None:
            raise PatchgenError(f"draft {argument!r}: a VLM is drafted from a shipped VLM spec: name the project")
        return Drafted(target, *draft_member(target, source, project))
    upstream = source.read(target.module)
    if isinstance(target, DitTarget):
        target = dataclasses.replace(target, name=name or target.name)
        condition = condition_model(project, source, target.cls, upstream.text, target.name)
        found = recognise_dit(target, upstream, condition[0], source)
        mod = Module(upstream)
        tiny, capabilities = dit_tiny(mod, target.cls), dit_capabilities(mod, target.cls)
        return Drafted(target, found, dit_spec_text(found, upstream.pin, tiny, capabilities, condition))
    found = recognise(target, upstream)
    config_text = source.read(target.config_module).text
    fields = config_fields(config_text, target.model_type)
    tiny, variants, capabilities, notes = tiny_config(found, Module(upstream), fields, config_text)
    return Drafted(target, found, spec_text(found, upstream.pin, tiny, variants, capabilities, notes))


def prove(config: ProjectConfig, spec: Spec, source: UpstreamSource) -> None:
    """Generate the draft in memory: every patch applies exactly once and the engine's checks pass, or one line."""
    from patchgen.generate import generate
    from patchgen.spec_set import check_model_upstream, check_module, check_output

    check_output(config, spec)
    check_module(config, spec)
    check_model_upstream(config, spec)
    try:
        generate(spec, source, config)
    except PatchgenError as exc:
        first = str(exc).splitlines()[0]
        raise PatchgenError(f"draft of {spec.name} does not generate, nothing written: {first}") from exc


def drafted_from(committed: dict, name: str) -> tuple[str, bool]:
    """(what to draft, whether a DiT) for a committed spec: a DiT's diffusers class, else its model type. A spec
    without a [model] record (skyreels_v2: no condition model here) is a DiT where it rewrites a diffusers transformer
    module and keeps its one class."""
    model = committed.get("model", {})
    upstream = str(model.get("upstream", ""))
    if model.get("family") == "dit" and upstream.startswith("diffusers."):
        return upstream.rsplit(".", 1)[1], True
    keep = committed.get("keep", [])
    if not model and str(committed.get("module", "")).startswith(DIT_MODULES) and len(keep) == 1:
        return str(keep[0]), True
    return model.get("model_type", name), False


def check_draft(config: ProjectConfig, name: str, source: UpstreamSource) -> int:
    """Print the diff committed spec -> fresh draft; 1 when they differ, 0 when not."""
    path = config.spec_path(name)
    if not path.is_file():
        raise PatchgenError(f"draft --check {name}: no {path.name} in {config.specs_dir}; draft it first")
    committed = path.read_text(encoding="utf-8")
    try:
        argument, dit = drafted_from(tomllib.loads(committed), name)
    except tomllib.TOMLDecodeError as exc:
        raise PatchgenError(f"{path}: not valid TOML ({exc}); fix it, or redraft with --force") from exc
    drafted = draft_spec(argument, source, config.pins, name if dit else None, config).text
    lines = list(
        difflib.unified_diff(
            committed.splitlines(keepends=True),
            drafted.splitlines(keepends=True),
            f"a/{path.name}",
            f"b/{path.name} (draft)",
        )
    )
    if not lines:
        typer.echo(f"{path.name}: equal to the draft")
        return 0
    typer.echo("".join(lines), nl=False)
    return 1
