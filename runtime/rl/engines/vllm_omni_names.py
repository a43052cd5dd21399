"""Parameter and module names of a vllm-omni transformer, read from its SOURCE (``ast``; nothing is imported: vllm-omni
cannot be imported with a CPU torch build), and the mapping of ours (diffusers' names) onto them for weight sync.

vllm-omni re-implements each DiT with vLLM layers: q/k/v fused into ``to_qkv`` (``add_kv_proj`` for the text
stream), and some output projections renamed (``to_out.0`` -> ``to_out`` in Wan and Qwen-Image, ``ffn.net.0`` ->
``ffn.net_0`` in Wan). Its ``load_weights`` takes diffusers names and maps them itself (a ``stacked_params_mapping``
list and ``.replace(old, new)`` renames), so a FULL weight sync sends our names unchanged. Its LoRA manager does not:
it looks adapters up by the ENGINE's module names (a fused module through ``packed_modules_mapping``), so a LoRA on
``attn1.to_out.0`` sent under that name binds nothing in Wan (a silent no-op: the engine keeps sampling the untrained
model). ``EngineNames`` therefore reads, from the transformer class's source:

* ``stacked``: ``load_weights``' ``stacked_params_mapping`` (engine param, our shard name, shard id);
* ``packed``: the class's ``packed_modules_mapping``;
* ``renames``: every literal ``.replace(old, new)`` in ``load_weights`` and the module functions it calls, and the
  exact-name remaps of its ``{str: str}`` dicts;
* the module tree: each class's ``self.<name> = <Layer>(...)`` attributes (``nn.ModuleList`` of blocks, appended
  lists, conditional layers), following classes defined in the file or imported from other vllm-omni files of the
  same source tree.

``lora_module(ours)`` is our module name under the engine's naming (renames applied; a fused member such as
``to_q`` stays: the manager finds it through ``packed``); ``full_weight(ours)`` is where ``load_weights`` puts our
parameter; ``resolve(path)`` checks a name against the module tree: ``True`` (a layer or parameter that exists),
``False`` (a class the source resolves has no such attribute) or ``None`` (the path enters a class defined outside
vllm-omni, e.g. a diffusers embedding, whose names are diffusers' own).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EngineNames", "Node"]

# Classes that are single layers: below them only their parameters (weight, bias) exist.
_LAYER_SUFFIXES = ("Linear", "Norm", "Conv1d", "Conv2d", "Conv3d", "Embedding", "Dropout", "Identity")


@dataclass(frozen=True)
class Node:
    """A module attribute: the class it holds (None: unknown/dynamic), whether it is a list of modules (the element
    classes by index when literal, else one class for every index), or a parameter."""

    cls: str | None = None
    is_list: bool = False
    elements: tuple[str | None, ...] = ()
    param: bool = False


def _callee(call: ast.AST) -> str | None:
    if not isinstance(call, ast.Call):
        return None
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _self_attr(target: ast.AST) -> str | None:
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
        return target.attr
    return None


def _node_of(value: ast.AST) -> Node | None:
    """The node an assignment ``self.x = value`` creates (None: not a module, e.g. a number, None, or vLLM's
    placeholder of another pipeline stage)."""
    if isinstance(value, ast.IfExp):
        return _node_of(value.body) or _node_of(value.orelse)
    name = _callee(value)
    if name is None or name == "PPMissingLayer":
        return None
    if name == "make_layers":  # vLLM's pipeline-parallel block list: make_layers(n, lambda prefix: Block(...))
        builder = next((a for a in value.args if isinstance(a, ast.Lambda)), None)
        return Node(cls=_callee(builder.body) if builder is not None else None, is_list=True)
    if name == "Parameter":
        return Node(param=True)
    if name in ("ModuleList", "Sequential"):
        args = value.args
        if not args:
            return Node(is_list=True)
        arg = args[0]
        if isinstance(arg, ast.ListComp | ast.GeneratorExp):
            return Node(cls=_callee(arg.elt), is_list=True)
        if isinstance(arg, ast.List):
            return Node(is_list=True, elements=tuple(_callee(e) for e in arg.elts))
        return Node(is_list=True)  # built elsewhere (a variable): elements unknown
    return Node(cls=name)


def _pairs(target: ast.AST, value: ast.AST) -> list[tuple[str, ast.AST]]:
    """``(attribute, value)`` of ``self.a = v`` and ``self.a, self.b = v1, v2``; a tuple assigned from one call
    (``start, end, self.blocks = make_layers(...)``) gives that call to its last attribute."""
    if _self_attr(target):
        return [(target.attr, value)]
    if isinstance(target, ast.Tuple):
        names = [_self_attr(t) for t in target.elts]
        if isinstance(value, ast.Tuple) and len(value.elts) == len(names):
            return [(n, v) for n, v in zip(names, value.elts, strict=True) if n]
        if names and names[-1]:
            return [(names[-1], value)]
    return []


@dataclass
class _Module:
    tree: ast.Module
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)
    imports: dict[str, tuple[str, str]] = field(default_factory=dict)  # local name -> (module, name)

    @classmethod
    def parse(cls, text: str) -> _Module:
        tree = ast.parse(text)
        out = cls(tree)
        for stmt in tree.body:
            if isinstance(stmt, ast.ClassDef):
                out.classes[stmt.name] = stmt
            elif isinstance(stmt, ast.FunctionDef):
                out.functions[stmt.name] = stmt
        for stmt in ast.walk(tree):
            if isinstance(stmt, ast.ImportFrom) and stmt.module:
                for alias in stmt.names:
                    out.imports[alias.asname or alias.name] = (stmt.module, alias.name)
        return out


@dataclass(frozen=True)
class EngineNames:
    root: str
    stacked: tuple[tuple[str, str, str], ...]
    packed: Mapping[str, tuple[str, ...]]
    renames: tuple[tuple[str, str], ...]
    exact: Mapping[str, str]
    attributes: Mapping[str, Mapping[str, Node]]  # "module:Class" -> attribute -> node
    classes: Mapping[str, str]  # "module:Class" -> kind: "local" (parsed) or "layer"

    # ---------------------------------------------------------------- reading the source
    @classmethod
    def from_sources(cls, read: Callable[[str], str | None], module: str, class_name: str) -> EngineNames:
        """The names of ``module.class_name``; ``read(dotted module) -> source text`` (None: not in the tree)."""
        parsed: dict[str, _Module] = {}

        def load(name: str) -> _Module | None:
            if name not in parsed:
                text = read(name) if name.startswith("vllm_omni") else None
                parsed[name] = None if text is None else _Module.parse(text)
            return parsed[name]

        root = load(module)
        if root is None or class_name not in root.classes:
            raise KeyError(f"{module}.{class_name} is not in the source tree")
        attributes: dict[str, dict[str, Node]] = {}
        kinds: dict[str, str] = {}

        def locate(mod_name: str, name: str | None) -> str | None:
            """The key ``module:Class`` of class ``name`` as seen from ``mod_name`` (None: not resolvable)."""
            if name is None:
                return None
            mod = load(mod_name)
            if mod is not None and name in mod.classes:
                return f"{mod_name}:{name}"
            if mod is not None and name in mod.imports:
                src, real = mod.imports[name]
                if load(src) is not None:
                    return locate(src, real)
                return f"<external {src}>:{real}"
            return f"<external>:{name}"  # e.g. nn.Linear: torch

        def visit(key: str) -> None:
            if key in kinds:
                return
            mod_name, _, name = key.partition(":")
            if mod_name.startswith("<external"):  # outside the tree: a torch / vLLM layer by its name, else opaque
                source = mod_name[len("<external") : -1].strip()
                layer = name.endswith(_LAYER_SUFFIXES) and (not source or source.startswith(("vllm", "torch")))
                kinds[key] = "layer" if layer else "external"
                return
            mod = load(mod_name)
            node = mod.classes[name]
            kinds[key] = "local"
            attrs: dict[str, Node] = {}
            for base in node.bases:  # attributes of a parsed base class come first
                if isinstance(base, ast.Attribute):  # nn.LayerNorm: torch's
                    base_key = None if base.attr == "Module" else f"<external>:{base.attr}"
                else:
                    base_key = locate(mod_name, base.id) if isinstance(base, ast.Name) else None
                if base_key is None or base_key == key or base_key.endswith(":Module"):
                    continue
                visit(base_key)
                if kinds[base_key] != "local":  # built on a layer (nn.LayerNorm) or an opaque class: the same
                    kinds[key] = kinds[base_key]
                    return
                attrs.update(attributes.get(base_key, {}))
            init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
            for stmt in ast.walk(init) if init is not None else ():
                if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                    for target, value in _pairs(stmt.targets[0], stmt.value):
                        found = _node_of(value)
                        if found is not None and (target not in attrs or attrs[target] == Node()):
                            attrs[target] = _resolved(found, mod_name)
                elif (
                    isinstance(stmt, ast.Call) and isinstance(stmt.func, ast.Attribute) and stmt.func.attr == "append"
                ):
                    owner = _self_attr(stmt.func.value)
                    if owner in attrs and attrs[owner].is_list and stmt.args:
                        old = attrs[owner]
                        attrs[owner] = Node(
                            is_list=True, elements=(*old.elements, locate(mod_name, _callee(stmt.args[0])))
                        )
            attributes[key] = attrs
            for child in attrs.values():
                for k in (child.cls, *child.elements):
                    if k is not None:
                        visit(k)

        def _resolved(node: Node, mod_name: str) -> Node:
            if node.param:
                return node
            return Node(
                cls=locate(mod_name, node.cls),
                is_list=node.is_list,
                elements=tuple(locate(mod_name, e) for e in node.elements),
            )

        root_key = f"{module}:{class_name}"
        visit(root_key)
        stacked, renames, exact, exposed = cls._load_weights_mappings(root, class_name)
        return cls(root_key, stacked, _lora_packed(stacked) if exposed else {}, renames, exact, attributes, kinds)

    @staticmethod
    def _load_weights_mappings(
        mod: _Module, class_name: str
    ) -> tuple[tuple[tuple[str, str, str], ...], tuple[tuple[str, str], ...], dict[str, str], bool]:
        """(stacked_params_mapping, literal renames, exact remaps, whether load_weights exposes the stacked
        mapping as ``self.stacked_params_mapping``: the LoRA manager reads fused members only from there)."""
        method = next(
            (f for f in mod.classes[class_name].body if isinstance(f, ast.FunctionDef) and f.name == "load_weights"),
            None,
        )
        if method is None:
            return (), (), {}, False
        exposed = any(
            isinstance(n, ast.Assign) and any(_self_attr(t) == "stacked_params_mapping" for t in n.targets)
            for n in ast.walk(method)
        )
        functions, queue = [method], [method]
        while queue:  # module functions load_weights calls, transitively
            for call in ast.walk(queue.pop()):
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in mod.functions:
                    f = mod.functions[call.func.id]
                    if f not in functions:
                        functions.append(f)
                        queue.append(f)
        stacked: list[tuple[str, str, str]] = []
        renames: list[tuple[str, str]] = []
        exact: dict[str, str] = {}
        for fn in functions:
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "stacked_params_mapping" for t in node.targets
                ):
                    stacked.extend(tuple(x) for x in ast.literal_eval(node.value))
                elif (
                    isinstance(node, ast.Dict)
                    and node.keys
                    and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys)
                ):
                    try:
                        value = ast.literal_eval(node)
                    except ValueError:
                        continue
                    if all(isinstance(v, str) for v in value.values()):
                        exact.update(value)
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "replace"
                    and len(node.args) == 2
                    and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args)
                ):
                    pair = (node.args[0].value, node.args[1].value)
                    if pair not in renames:
                        renames.append(pair)
        return tuple(stacked), tuple(renames), exact, exposed

    # ---------------------------------------------------------------- mapping ours onto the engine's
    def _renamed(self, name: str, module: bool) -> str:
        """``name`` as the engine has it: unchanged when the engine has it (the loaders rename only what is not
        there: Flux keeps ``to_out.0``), else with the exact remaps and literal renames applied."""
        if self.resolve(name, module=module) is not False:
            return name
        if name in self.exact:
            return self.exact[name]
        dotted = f".{name}."
        for old, new in self.renames:
            if old.startswith(".") and old in dotted:
                dotted = dotted.replace(old, new)
        return dotted[1:-1]

    def full_weight(self, name: str) -> tuple[str, str | None]:
        """Where the engine's ``load_weights`` puts our parameter ``name``: (engine parameter, shard id or None)."""
        for param, shard_name, shard_id in self.stacked:
            if shard_name in name:
                return name.replace(shard_name, param), shard_id
        return self._renamed(name, module=False), None

    def lora_module(self, module: str) -> str:
        """Our LoRA-adapted module ``module`` under the engine's module names (a fused member keeps its name)."""
        return self._renamed(module, module=True)

    # ---------------------------------------------------------------- checking names against the module tree
    def resolve(self, path: str, *, module: bool = False) -> bool | None:
        """Whether ``path`` (a parameter, or with ``module`` a module that must be a layer) exists in the engine's
        module tree (see the module docstring)."""
        parts = path.split(".")
        key: str | None = self.root
        i = 0
        while i < len(parts):
            kind = self.classes.get(key) if key else None
            if key is None or kind == "external":
                return None
            if kind == "layer":  # a single layer: only a parameter name may follow
                return not module and i == len(parts) - 1
            attrs = self.attributes.get(key, {})
            seg = parts[i]
            if seg not in attrs:
                last = i == len(parts) - 1
                if module and last and any(seg in members for p, members in self.packed.items() if p in attrs):
                    return True  # a fused member (to_q of to_qkv): the manager binds it by packed_modules_mapping
                return False
            node = attrs[seg]
            i += 1
            if node.param:
                return not module and i == len(parts)
            if node.is_list:
                if i == len(parts) or not parts[i].isdigit():
                    return False
                index = int(parts[i])
                i += 1
                if node.elements:
                    if index >= len(node.elements):
                        return False
                    key = node.elements[index]
                else:
                    key = node.cls
            else:
                key = node.cls
        kind = self.classes.get(key) if key else None
        return True if kind == "layer" else (None if kind in (None, "external") else module)


def _lora_packed(stacked: tuple[tuple[str, str, str], ...]) -> dict[str, tuple[str, ...]]:
    """The fused -> member leaf names the LoRA manager derives from a stacked mapping (``.attn1.to_qkv`` ->
    ``to_qkv``)."""
    out: dict[str, list[str]] = {}
    for packed, member, _ in stacked:
        names = out.setdefault(packed.strip(".").split(".")[-1], [])
        leaf = member.strip(".").split(".")[-1]
        if leaf not in names:
            names.append(leaf)
    return {k: tuple(v) for k, v in out.items()}


def read_wheel(path: Any) -> Callable[[str], str | None]:
    """``read(dotted module)`` over a wheel's ``.py`` files (a zip; nothing is extracted or imported)."""
    import zipfile

    archive = zipfile.ZipFile(path)
    names = set(archive.namelist())

    def read(module: str) -> str | None:
        base = module.replace(".", "/")
        for candidate in (f"{base}.py", f"{base}/__init__.py"):
            if candidate in names:
                return archive.read(candidate).decode("utf-8")
        return None

    return read
