"""Which keys a ``model.config`` may set: the config class's own, so that a typo is an error and not a new attribute.

transformers' config classes accept any keyword and keep unknown ones as plain attributes, so ``hiden_size: 64``
would silently train the default hidden size. The known keys of a config class are its ``__init__`` parameters,
its annotated and plain class attributes along the MRO, its ``attribute_map`` aliases and the legacy RoPE keys its
RoPE mixin folds into ``rope_parameters``; a sub-config (a VLM's ``text_config`` / ``vision_config``) given as a
mapping is checked against its own class. Modeling code also reads a few attributes its config class does not
declare, with ``getattr(config, "name", default)`` (qwen3_moe's ``head_dim``): those read by the model's module and
transformers' shared modeling helpers count as known too (``keys_read_by``).
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Iterable
from typing import Any

from runtime.train.config_source import ConfigKeys, source_path, static_config_keys, transformers_config_name
from runtime.train.model_limits import size_problems

# RotaryEmbeddingConfigMixin.convert_rope_params_to_dict moves these into rope_parameters (transformers 5).
_LEGACY_ROPE_KEYS = ("rope_theta", "partial_rotary_factor")


def known_config_keys(config_class: type) -> set[str]:
    """Every key ``config_class(**{key: value})`` understands."""
    keys = {
        name
        for name, p in inspect.signature(config_class.__init__).parameters.items()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name != "self"
    }
    for klass in config_class.__mro__:
        keys.update(k for k in vars(klass).get("__annotations__", {}) if not k.startswith("_"))
        keys.update(
            k
            for k, v in vars(klass).items()
            if not k.startswith("_") and not callable(v) and not isinstance(v, classmethod | staticmethod)
        )
        if klass.__name__ == "RotaryEmbeddingConfigMixin":
            keys.update(_LEGACY_ROPE_KEYS)
    keys.update(getattr(config_class, "attribute_map", None) or {})
    return keys


_GETATTR_READ = re.compile(r"getattr\(\s*(?:self\.)?\w*config\s*,\s*[\"'](\w+)[\"']")
# transformers' helpers that read config attributes for every model (RoPE, weight tying, attention setup)
SHARED_MODELING_MODULES = ("transformers.modeling_rope_utils", "transformers.modeling_utils")


def keys_read_by(modules: Iterable[str]) -> set[str]:
    """Attribute names the source of ``modules`` reads with ``getattr(<...>config, "name"...)`` (nothing imported:
    the files are found from their top-level package's directory)."""
    keys: set[str] = set()
    for module in modules:
        path = source_path(module)
        if path is None:
            continue
        keys.update(_GETATTR_READ.findall(path.read_text(encoding="utf-8")))
    return keys


def _sub_config_class(config_class: type, key: str) -> type | None:
    sub = (getattr(config_class, "sub_configs", None) or {}).get(key)
    # AutoConfig (any model's config) cannot be checked without knowing the model type
    return sub if isinstance(sub, type) and hasattr(sub, "__mro__") and sub.__name__ != "AutoConfig" else None


def imported_config_keys(config_class: type) -> ConfigKeys:
    """``known_config_keys`` of an imported config class and of its sub-config classes."""
    subs = {
        key: (imported_config_keys(sub) if (sub := _sub_config_class(config_class, key)) is not None else None)
        for key in getattr(config_class, "sub_configs", None) or {}
    }
    attribute_map = frozenset(getattr(config_class, "attribute_map", None) or {})
    return ConfigKeys(config_class.__name__, frozenset(known_config_keys(config_class)), subs, attribute_map)


def config_class_keys(model_type: str) -> ConfigKeys | None:
    """The keys of ``transformers.CONFIG_MAPPING[model_type]``, read from source (no torch); when the source reader
    cannot resolve the class, from the imported class (imports transformers and torch). None: not a transformers
    model type."""
    if transformers_config_name(model_type) is None:
        return None
    found = static_config_keys(model_type)
    if found is not None:
        return found
    from transformers import CONFIG_MAPPING

    return imported_config_keys(CONFIG_MAPPING[model_type]) if model_type in CONFIG_MAPPING else None


def unknown_config_keys(
    config_class: ConfigKeys,
    overrides: dict[str, Any],
    prefix: str = "model.config",
    parent: ConfigKeys | None = None,
    read: frozenset[str] = frozenset(),
) -> list[str]:
    """A one-line message for every key of ``overrides`` that ``config_class`` does not know (sub-configs
    included), with the closest known key. ``read``: keys the modeling code reads (``keys_read_by``), known at every
    level."""
    known = config_class.keys | read
    found: list[str] = []
    for key, value in overrides.items():
        where = f"{prefix}.{key}"
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
            if parent is not None and key in parent.keys:
                hint = f"; it belongs to {prefix.rsplit('.', 1)[0]} ({parent.name})"
            else:
                hint = f"; did you mean {close[0]!r}?" if close else ""
            found.append(f"{where}: unknown key for {config_class.name}{hint}")
            continue
        sub = config_class.sub_configs.get(key)
        if sub is not None and isinstance(value, dict):
            found.extend(unknown_config_keys(sub, value, where, config_class, read))
    return found


def model_type_problem(model_type: Any) -> str | None:
    """Why ``model_type`` cannot be trained or planned (no generated class), with the closest known type; None when
    the registry has it (``runtime/models/registry.py``: the generated ``*.model.json`` records, nothing imported)."""
    from runtime.models.registry import REGISTRY

    if model_type is None or model_type in REGISTRY:
        return None
    close = difflib.get_close_matches(str(model_type), sorted(REGISTRY), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return (
        f"model.type: no generated model for model_type {model_type!r}{hint} (known: {', '.join(sorted(REGISTRY))}). "
        f"Add a spec with a [model] table under specs/ and run `patchgen regen`"
    )


def model_config_problems(model_type: str, module: str, overrides: dict[str, Any]) -> list[str]:
    """Every problem of ``model.config`` of a transformers model: keys its config class (or the modeling code of
    ``module``) does not know, and sizes outside ``runtime/train/model_limits.py``'s bounds, one line each. Shared by
    the trainer and ``python -m runtime.plan`` so that both refuse the same typo (``hiden_size``) and the same
    sizes; read from source, no torch."""
    found: list[str] = []
    known = config_class_keys(model_type)
    if known is not None:
        read = frozenset(keys_read_by([module, *SHARED_MODELING_MODULES]))
        found.extend(unknown_config_keys(known, overrides, read=read))
    found.extend(f"model.config.{key}: {what}" for key, what in size_problems(overrides))
    return found
