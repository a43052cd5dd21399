"""The kinds a template variable can declare, and how a spec value of each kind becomes template input.

Spec values are data: each one is validated against its kind before rendering, and what reaches the template is
code that cannot add a statement (names, dotted names, one normalized expression, numbers, a quoted string literal,
or one of the words the template itself declared). An `expr` is also code that cannot *do* anything: its grammar
(`expr_problem`) has no calls (but two named, read-only methods), no lambdas, comprehensions, walrus, f-strings or
dunder names, because a rendered value runs when the generated module is imported or called (a parameter default
runs at import; `upgrade --verify` imports regenerated modules without a human having read them).
"""

from __future__ import annotations

import ast
import json
import keyword
import math
import re
from dataclasses import dataclass
from typing import Any

SCALAR_KINDS = ("int", "float", "bool", "identifier", "dotted", "expr", "str", "word")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
MAX_VALUE_CHARS = 2000  # a spec value is a name or a short expression; anything longer is a mistake
MAX_LIST_ITEMS = 256

DESCRIPTIONS = {
    "int": "an integer",
    "float": "a finite number",
    "bool": "true or false",
    "identifier": "a Python name (letters, digits, _; not a keyword)",
    "dotted": "a dotted Python name such as config.vision_config",
    "expr": "exactly one Python expression of names, attributes, constants, subscripts, slices, tuples, lists, "
    "operators and `a if c else b` (no calls but kwargs.get(<constant>) and <config>.get_text_config(); no "
    "lambdas, comprehensions, f-strings or dunder names)",
    "str": "a string (rendered as a quoted literal)",
    "word": "one of the template's declared choices",
}


# The only calls an expr may make, each because a template default or a spec needs it, both read-only: method name
# -> (the one receiver name it may be called on, None for any receiver the grammar allows; most constant arguments).
ALLOWED_METHODS = {
    "get": ("kwargs", 2),  # a function's **kwargs: moe/global_aux_loss reads kwargs.get("token_mask")
    "get_text_config": (None, 0),  # transformers' PretrainedConfig: specs/qwen3_omni_moe.toml's vocab size
}
_EXPR_NODES = (
    ast.Expression,
    ast.Name,
    ast.Attribute,
    ast.Constant,
    ast.Subscript,
    ast.Slice,
    ast.Tuple,
    ast.List,
    ast.UnaryOp,
    ast.BinOp,
    ast.BoolOp,
    ast.Compare,
    ast.IfExp,
    ast.expr_context,
    ast.operator,
    ast.unaryop,
    ast.boolop,
    ast.cmpop,
)


class VarError(ValueError):
    """A spec value that does not fit its declared kind; the message says what was expected."""


@dataclass(frozen=True)
class Kind:
    scalar: str
    is_list: bool = False

    @property
    def name(self) -> str:
        return f"list[{self.scalar}]" if self.is_list else self.scalar


def parse_kind(text: Any) -> Kind | None:
    """`int`, `list[identifier]`, ... -> Kind; None when the text names no kind."""
    if not isinstance(text, str):
        return None
    match = re.fullmatch(r"list\[(\w+)\]", text)
    scalar = match.group(1) if match else text
    return Kind(scalar, match is not None) if scalar in SCALAR_KINDS else None


def is_identifier(text: str) -> bool:
    return bool(_IDENTIFIER.match(text)) and not keyword.iskeyword(text)


def is_dotted(text: str) -> bool:
    return all(is_identifier(part) for part in text.split("."))


def _dunder(name: str) -> bool:
    return name.startswith("__")


def expr_problem(tree: ast.AST) -> str | None:
    """Why a parsed expr value is outside the grammar (None when it is inside): what it may hold is listed in
    DESCRIPTIONS["expr"]; a call only as ALLOWED_METHODS says, with constant positional arguments."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = f".{func.attr}" if isinstance(func, ast.Attribute) else getattr(func, "id", type(func).__name__)
            receiver, most = ALLOWED_METHODS.get(name[1:], ("", -1)) if name.startswith(".") else ("", -1)
            if most < 0 or receiver is not None and getattr(func.value, "id", None) != receiver:
                return f"it calls {name}(...)"
            if node.keywords or len(node.args) > most or not all(isinstance(a, ast.Constant) for a in node.args):
                return f"{name}(...) takes at most {most} constant positional argument(s)"
        elif isinstance(node, ast.Name) and _dunder(node.id) or isinstance(node, ast.Attribute) and _dunder(node.attr):
            return f"it names {node.id if isinstance(node, ast.Name) else node.attr}"
        elif not isinstance(node, _EXPR_NODES):
            return f"it holds a {type(node).__name__}"
    return None


def _prepare_expr(value: str) -> str:
    try:
        tree = ast.parse(value.strip(), mode="eval")
        normalized = ast.unparse(tree)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise VarError(f"{DESCRIPTIONS['expr']}, found {_found(value)}") from None
    problem = expr_problem(tree)
    if problem is not None:
        raise VarError(f"{DESCRIPTIONS['expr']}, found {_found(value)}: {problem}")
    return normalized


def type_name(value: Any) -> str:
    names = {str: "string", int: "integer", float: "float", bool: "boolean", list: "array", dict: "table"}
    return names.get(type(value), type(value).__name__)


def _found(value: Any) -> str:
    text = repr(value)
    return f"{type_name(value)} {text if len(text) <= 80 else text[:77] + '...'}"


def prepare_scalar(scalar: str, value: Any, choices: tuple[str, ...] = ()) -> Any:
    """The template input for one value of kind `scalar`, or VarError."""
    if scalar == "bool":
        if isinstance(value, bool):
            return value
    elif scalar == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif scalar == "float":
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif isinstance(value, str) and len(value) <= MAX_VALUE_CHARS:
        if scalar == "str":
            return json.dumps(value)  # a JSON string (ASCII, escaped) is a valid Python string literal
        if scalar == "identifier" and is_identifier(value):
            return value
        if scalar == "dotted" and is_dotted(value):
            return value
        if scalar == "word" and value in choices:
            return value
        if scalar == "expr":
            return _prepare_expr(value)
    expected = DESCRIPTIONS[scalar]
    if scalar == "word":
        expected = f"one of {list(choices)}"
    raise VarError(f"{expected}, found {_found(value)}")


def prepare(kind: Kind, value: Any, choices: tuple[str, ...] = ()) -> Any:
    """Validate `value` against `kind` and return what the template receives."""
    if not kind.is_list:
        return prepare_scalar(kind.scalar, value, choices)
    if not isinstance(value, list) or len(value) > MAX_LIST_ITEMS:
        raise VarError(f"an array of {DESCRIPTIONS[kind.scalar]}, found {_found(value)}")
    out = []
    for position, item in enumerate(value):
        try:
            out.append(prepare_scalar(kind.scalar, item, choices))
        except VarError as exc:
            raise VarError(f"an array whose every item is {exc} (item {position} of {_found(value)})") from None
    return out
