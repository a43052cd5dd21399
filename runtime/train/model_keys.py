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
import importlib.util
import inspect
import re
from collections.abc import Iterable
from typing import Any

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
    """Attribute names the source of ``modules`` reads with ``getattr(<...>config, "name"...)`` (not imported)."""
    keys: set[str] = set()
    for module in modules:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        with open(spec.origin, encoding="utf-8") as f:
            keys.update(_GETATTR_READ.findall(f.read()))
    return keys


def _sub_config_class(config_class: type, key: str) -> type | None:
    sub = (getattr(config_class, "sub_configs", None) or {}).get(key)
    # AutoConfig (any model's config) cannot be checked without knowing the model type
    return sub if isinstance(sub, type) and hasattr(sub, "__mro__") and sub.__name__ != "AutoConfig" else None


def unknown_config_key(
    config_class: type,
    overrides: dict[str, Any],
    prefix: str = "model.config",
    parent: type | None = None,
    read: frozenset[str] = frozenset(),
) -> str | None:
    """A one-line message for the first key of ``overrides`` that ``config_class`` does not know (sub-configs
    included), with the closest known key; None when every key is known. ``read``: keys the modeling code reads
    (``keys_read_by``), known at every level."""
    known = known_config_keys(config_class) | read
    for key, value in overrides.items():
        where = f"{prefix}.{key}"
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
            if parent is not None and key in known_config_keys(parent):
                hint = f"; it belongs to {prefix.rsplit('.', 1)[0]} ({parent.__name__})"
            else:
                hint = f"; did you mean {close[0]!r}?" if close else ""
            return f"{where}: unknown key for {config_class.__name__}{hint}"
        sub = _sub_config_class(config_class, key)
        if sub is not None and isinstance(value, dict):
            found = unknown_config_key(sub, value, where, config_class, read)
            if found:
                return found
    return None
