"""The jinja2 environment templates render in, and the limits of one rendering.

The base is jinja2's immutable sandbox (no attribute starting with `_`, no mutation of lists and dicts) with no
globals (no range, lipsum, cycler, namespace) and StrictUndefined. On top of it, limits make a template fail fast
with a message naming the limit, instead of exhausting memory or time:
- MAX_VALUE: nothing a template builds (by `*`, `+`, `~`, `**`, a filter or a method) holds more than this many
  characters or items (nested ones counted), and no integer more bits; nothing bigger is printed or passed on;
- MAX_OUTPUT_CHARS: all the text one rendering produces, blocks captured by `{% set %}` and macro bodies included;
- MAX_STEPS: loop iterations plus calls (macros, loop helpers, methods) in one rendering.
Filters and methods are allowlists of those whose result is bounded by their input (`join` and `replace` are
sized before they run); `%` does not format strings (a width is a size).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Iterable, Iterator
from typing import Any

import jinja2
import jinja2.sandbox
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.filters import make_attrgetter
from jinja2.nodes import EvalContext
from jinja2.runtime import Context, LoopContext, Macro

MAX_VALUE = 1_000_000  # above the largest spec input (256 items of 2000 characters: patchgen.varkinds)
MAX_OUTPUT_CHARS = 4_000_000
MAX_STEPS = 100_000

FILTERS = (
    "abs", "capitalize", "count", "d", "default", "dictsort", "first", "float", "int", "items", "join", "last",
    "length", "list", "lower", "map", "max", "min", "reject", "rejectattr", "replace", "reverse", "round", "select",
    "selectattr", "sort", "title", "tojson", "trim", "unique", "upper",
)  # fmt: skip
_STR_METHODS = (
    "capitalize", "count", "endswith", "find", "index", "isalnum", "isalpha", "isdigit", "isidentifier", "islower",
    "isupper", "join", "lower", "lstrip", "partition", "removeprefix", "removesuffix", "replace", "rfind", "rindex",
    "rpartition", "rsplit", "rstrip", "split", "splitlines", "startswith", "strip", "title", "upper",
)  # fmt: skip
METHODS = {
    str: frozenset(_STR_METHODS),
    dict: frozenset({"get", "items", "keys", "values"}),
    list: frozenset({"count", "index"}),
    tuple: frozenset({"count", "index"}),
}

# [steps, characters produced] of the rendering under way; None while compiling (constant folding)
_BUDGET: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("patchgen_render_budget", default=None)


class LimitError(jinja2.sandbox.SecurityError):
    """A template went over one of the limits; the message names it."""


def render(template: jinja2.Template, values: dict[str, Any]) -> str:
    """Render with a fresh budget of steps and characters."""
    token = _BUDGET.set([0, 0])
    try:
        return template.render(**values)
    finally:
        _BUDGET.reset(token)


def size(value: Any, limit: int = MAX_VALUE) -> int:
    """Characters or items in `value`, nested ones included (an integer counts its decimal digits); counting stops
    once past `limit`, so sizing a huge value costs no more than the limit."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() * 3 // 10 + 1
    if isinstance(value, dict):
        value = value.items()
    if isinstance(value, list | tuple | set | frozenset | type({}.items())):
        total = len(value)
        for item in value:
            if total > limit:
                break
            total += size(item, limit - total)
        return total
    return 1


def _check(amount: int, what: str = "a value of") -> None:
    if amount > MAX_VALUE:
        raise LimitError(
            f"{what} {amount} characters or items: over the {MAX_VALUE} a template may build (patchgen.sandbox."
            f"MAX_VALUE)"
        )


def _step() -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget[0] += 1
        if budget[0] > MAX_STEPS:
            raise LimitError(f"more than {MAX_STEPS} loop iterations and calls (patchgen.sandbox.MAX_STEPS)")


def _produce(value: Any) -> str:
    """Every piece of output passes here (the environment's `finalize`): printed values and template text."""
    _check(size(value), "printing")
    text = str(value)
    budget = _BUDGET.get()
    if budget is not None:
        budget[1] += len(text)
        if budget[1] > MAX_OUTPUT_CHARS:
            raise LimitError(f"more than {MAX_OUTPUT_CHARS} characters of output (patchgen.sandbox.MAX_OUTPUT_CHARS)")
    return text


def _counted(iterable: Iterable[Any]) -> Iterator[Any]:
    """What a `{% for %}` loop iterates over: every iteration is a step."""
    for item in iterable:
        _step()
        yield item


def _literal(text: str) -> str:
    """Template text between tags, routed through `finalize` so it counts as output (see `_parse`)."""
    return text


def _join_size(items: list, separator: Any) -> int:
    return size(items, MAX_VALUE) + len(str(separator)) * max(len(items) - 1, 0)


def _replace_size(text: str, old: Any, new: Any, count: int | None = None) -> int:
    text, old, new = str(text), str(old), str(new)
    hits = len(text) + 1 if not old else text.count(old)
    if count is not None and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(len(new) - len(old), 0)


def _bounded_filter(name: str, function: Any) -> Any:
    """A builtin filter whose inputs are sized first (and, for join/replace, the result before it is built)."""

    @functools.wraps(function)  # keeps jinja2's pass_context/pass_eval_context marker
    def bounded(*args: Any, **kwargs: Any) -> Any:
        context = [a for a in args if isinstance(a, Context | EvalContext | jinja2.Environment)]
        values = args[len(context) :]
        for value in (*values, *kwargs.values()):
            _check(size(value), f"filter {name!r} given")
        if name == "join" and values:
            items = list(values[0])  # once: it may be a generator (`map`, `select`)
            attribute = kwargs.pop("attribute", values[2] if len(values) > 2 else None)
            if attribute is not None:
                items = list(map(make_attrgetter(getattr(context[0], "environment", context[0]), attribute), items))
            args = (*context, items, *values[1:2])
            _check(_join_size(items, kwargs.get("d", values[1] if len(values) > 1 else "")), "joining")
        if name == "replace" and len(values) >= 3:
            _check(
                _replace_size(*values[:3], kwargs.get("count", values[3] if len(values) > 3 else None)), "replacing"
            )
        return function(*args, **kwargs)

    return bounded


class _CodeGenerator(CodeGenerator):
    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        """`a ~ b`: sized before the strings are joined (jinja2 joins them inline, out of the sandbox's reach)."""
        self.write("environment.concat_values((")
        for argument in node.nodes:
            self.visit(argument, frame)
            self.write(", ")
        self.write("))")


class BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox with the limits of the module docstring."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _CodeGenerator

    def __init__(self) -> None:
        super().__init__(
            undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False, finalize=_produce
        )
        self.globals.clear()
        self.filters = {name: _bounded_filter(name, self.filters[name]) for name in FILTERS}
        self.counted, self.literal = _counted, _literal

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        """Every loop iterates through `counted`, and template text is output through `literal` (so `finalize`
        counts it): a loop or a captured block cannot do unbounded work out of sight."""
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = self._helper_call("counted", loop.iter)
        for output in tree.find_all(nodes.Output):
            output.nodes = [
                self._helper_call("literal", nodes.Const(n.data, lineno=n.lineno))
                if isinstance(n, nodes.TemplateData)
                else n
                for n in output.nodes
            ]
        return tree

    def _helper_call(self, helper: str, argument: nodes.Expr) -> nodes.Call:
        call = nodes.Call(nodes.EnvironmentAttribute(helper), [argument], [], None, None, lineno=argument.lineno)
        call.set_environment(self)
        return call

    def call(self, context: Context, function: Any, /, *args: Any, **kwargs: Any) -> Any:
        """Calls from a template: macros, loop helpers and the allowlisted methods; each one is a step."""
        _step()
        owner = getattr(function, "__self__", None)
        if function is _counted or function is _literal or isinstance(function, Macro | LoopContext):
            return context.call(function, *args, **kwargs)
        if isinstance(owner, LoopContext):  # loop.cycle(...), loop.changed(...)
            return context.call(function, *args, **kwargs)
        allowed = METHODS.get(type(owner), frozenset())
        name = getattr(function, "__name__", "")
        if type(function).__name__ != "builtin_function_or_method" or name not in allowed:
            what = getattr(function, "__qualname__", None) or repr(function)
            raise jinja2.sandbox.SecurityError(
                f"templates may not call {what}; they call macros, loop helpers and the methods "
                f"{', '.join(f'{t.__name__}.{m}' for t, ms in METHODS.items() for m in sorted(ms))}"
            )
        for value in (*args, *kwargs.values()):
            _check(size(value), f"{type(owner).__name__}.{name} given")
        if name == "join":
            _check(_join_size(list(args[0]) if args else [], owner), "joining")
        elif name == "replace":
            _check(_replace_size(owner, *args[:3]), "replacing")
        return context.call(function, *args, **kwargs)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        """`*`, `**` and `+` sized before they run; `%` only between numbers."""
        numbers = all(isinstance(v, int | float) for v in (left, right))
        if operator == "%" and not numbers:
            raise LimitError("the '%' operator only takes numbers here (formatting a string would take a width)")
        if operator == "*":
            if isinstance(left, int) and not isinstance(right, int | float):
                left, right = right, left
            if isinstance(right, int) and not isinstance(right, bool):
                if isinstance(left, int):
                    _check(size(left) + size(right), "a product of")
                elif not isinstance(left, float):
                    _check(size(left) * max(right, 0), "a product of")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            _check((abs(left).bit_length() - 1) * right * 3 // 10 + 1, "a power of")
        elif operator == "+" and not numbers:
            _check(size(left) + size(right), "a sum of")
        return super().call_binop(context, operator, left, right)

    def concat_values(self, values: tuple[Any, ...]) -> str:
        _check(sum(size(value) for value in values), "a concatenation of")
        return "".join(map(str, values))
