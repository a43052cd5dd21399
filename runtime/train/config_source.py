"""The keys a transformers config class knows, read from transformers' source files without importing transformers.

``import transformers`` imports torch (16-22 s on a loaded machine, ~1 s warm), and a run config must be checked in
well under two seconds. The config classes of transformers 5 are dataclasses whose keys are spelled out in their
class bodies (annotated fields, plain class attributes, ``attribute_map``, ``sub_configs``), so parsing the source
(``ast``) finds what ``runtime/train/model_keys.py`` finds on the imported class. ``tests/hostile/
test_train_config.py`` checks that both agree for every registered model type; a class this reader cannot resolve
gives None and the caller falls back to the import.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

# RotaryEmbeddingConfigMixin.convert_rope_params_to_dict moves these into rope_parameters (transformers 5).
LEGACY_ROPE_KEYS = ("rope_theta", "partial_rotary_factor")
_ROPE_MIXIN = "RotaryEmbeddingConfigMixin"


@dataclass(frozen=True)
class ConfigKeys:
    """A config class's known keys and its sub-config classes (None: ``AutoConfig``, any model's config)."""

    name: str
    keys: frozenset[str]
    sub_configs: dict[str, ConfigKeys | None] = field(default_factory=dict, hash=False)
    attribute_map: frozenset[str] = frozenset()


def source_path(dotted: str) -> Path | None:
    """The ``.py`` file of module ``dotted`` found from its top-level package's directory: nothing is imported
    (``importlib.util.find_spec("a.b")`` would import ``a``)."""
    top, *rest = dotted.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None:
        return None
    if not rest:
        return Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None
    if not spec.submodule_search_locations:
        return None
    base = Path(next(iter(spec.submodule_search_locations))).joinpath(*rest)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.lru_cache(maxsize=64)
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _module_of(path: Path, node: ast.ImportFrom) -> Path | None:
    """The file an ``from X import ...`` in ``path`` reads from (relative and absolute ``transformers`` imports)."""
    if node.level:
        base = path.parent
        for _ in range(node.level - 1):
            base = base.parent
        target = base.joinpath(*node.module.split(".")) if node.module else base
        for candidate in (target.with_suffix(".py"), target / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None
    return source_path(node.module) if node.module and node.module.startswith("transformers") else None


def _find_class(path: Path, name: str, depth: int = 0) -> tuple[Path, ast.ClassDef] | None:
    """The definition of class ``name`` as seen from module ``path``: defined there or imported (re-exports
    followed)."""
    if depth > 8:
        return None
    tree = _parse(path)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return path, node
    for node in ast.walk(tree):  # imports inside `if TYPE_CHECKING:` / try blocks count as well
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = _module_of(path, node)
                    found = source and _find_class(source, alias.name, depth + 1)
                    if found:
                        return found
    return None


def _dict_keys_and_names(node: ast.expr) -> dict[str, str | None] | None:
    """A class body's ``{"key": ClassName, ...}`` literal: key -> the class name (None when not a plain name)."""
    if not isinstance(node, ast.Dict):
        return None
    out: dict[str, str | None] = {}
    for key, value in zip(node.keys, node.values, strict=True):
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            out[key.value] = value.id if isinstance(value, ast.Name) else None
    return out


def _is_property(node: ast.FunctionDef) -> bool:
    for deco in node.decorator_list:
        if isinstance(deco, ast.Name) and deco.id == "property":
            return True
        if isinstance(deco, ast.Attribute) and deco.attr in ("setter", "getter", "deleter"):
            return True
    return False


def _body_keys(cls: ast.ClassDef) -> set[str]:
    """Public names the class body binds to a non-callable value: annotated fields, plain attributes, properties."""
    keys: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            keys.add(node.target.id)
        elif isinstance(node, ast.Assign):
            if isinstance(node.value, ast.Lambda):
                continue
            keys.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.FunctionDef) and _is_property(node):
            keys.add(node.name)
    return {k for k in keys if not k.startswith("_")}


def _init_parameters(cls: ast.ClassDef) -> set[str] | None:
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is None:
        return None
    args = init.args
    return {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)} - {"self"}


def _lineage(path: Path, cls: ast.ClassDef) -> list[tuple[Path, ast.ClassDef]] | None:
    """The class and its bases, depth first left to right (the MRO for the config classes' single chains and
    mixins); None when a base cannot be found."""
    out: list[tuple[Path, ast.ClassDef]] = [(path, cls)]
    for base in cls.bases:
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        if name in (None, "object", "Generic"):
            continue
        found = _find_class(path, name)
        if found is None:
            return None
        rest = _lineage(*found)
        if rest is None:
            return None
        out.extend(item for item in rest if all(item[1] is not seen[1] for seen in out))
    return out


def _class_keys(path: Path, name: str, depth: int = 0) -> ConfigKeys | None:
    found = _find_class(path, name)
    lineage = found and _lineage(*found)
    if not lineage or depth > 4:
        return None
    keys: set[str] = set()
    attribute_map: dict[str, str | None] | None = None
    sub_configs: dict[str, str | None] | None = None
    for _, cls in lineage:
        keys |= _body_keys(cls)
        if cls.name == _ROPE_MIXIN:
            keys.update(LEGACY_ROPE_KEYS)
        for node in cls.body:
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
            target = node.target if isinstance(node, ast.AnnAssign) else target
            if isinstance(target, ast.Name) and node.value is not None:
                if target.id == "attribute_map" and attribute_map is None:
                    attribute_map = _dict_keys_and_names(node.value) or {}
                if target.id == "sub_configs" and sub_configs is None:
                    sub_configs = _dict_keys_and_names(node.value) or {}
    init = _init_parameters(lineage[0][1])
    if init is not None:  # an explicit __init__ (else the dataclass one: the annotated fields, counted above)
        keys |= init
    keys |= set(attribute_map or {})
    subs: dict[str, ConfigKeys | None] = {}
    for key, sub_name in (sub_configs or {}).items():
        if sub_name is None or sub_name == "AutoConfig":
            subs[key] = None
            continue
        sub = _class_keys(found[0], sub_name, depth + 1)
        if sub is None:
            return None
        subs[key] = sub
    return ConfigKeys(name, frozenset(keys), subs, frozenset(attribute_map or {}))


def _mapping_literal(tree: ast.Module, name: str) -> dict[str, str]:
    """``NAME = OrderedDict([("a", "b"), ...])`` at the top of ``tree`` as a dict."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            call = node.value
            if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.List | ast.Tuple):
                pairs = (ast.literal_eval(item) for item in call.args[0].elts)
                return {k: v for k, v in pairs if isinstance(k, str) and isinstance(v, str)}
    return {}


@functools.lru_cache(maxsize=1)
def _auto_mappings() -> tuple[dict[str, str], dict[str, str]]:
    path = source_path("transformers.models.auto.auto_mappings")
    if path is None:
        return {}, {}
    tree = _parse(path)
    return (
        _mapping_literal(tree, "CONFIG_MAPPING_NAMES"),
        _mapping_literal(tree, "SPECIAL_MODEL_TYPE_TO_MODULE_NAME"),
    )


@functools.lru_cache(maxsize=64)
def static_config_keys(model_type: str) -> ConfigKeys | None:
    """The keys of ``transformers.CONFIG_MAPPING[model_type]`` read from source; None when this reader cannot say
    (an unknown type, or a class it cannot resolve)."""
    names, modules = _auto_mappings()
    class_name = names.get(model_type)
    if class_name is None:
        return None
    module = modules.get(model_type, model_type.replace("-", "_"))
    package = source_path(f"transformers.models.{module}")
    if package is None:
        return None
    folder = package.parent
    preferred = folder / f"configuration_{module}.py"
    for path in (preferred, *sorted(p for p in folder.glob("configuration_*.py") if p != preferred)):
        if path.is_file() and any(isinstance(n, ast.ClassDef) and n.name == class_name for n in _parse(path).body):
            return _class_keys(path, class_name)
    return None


def transformers_config_name(model_type: str) -> str | None:
    """The config class name transformers maps ``model_type`` to (its auto mappings, read from source)."""
    return _auto_mappings()[0].get(model_type)
