"""A stated attention layout checked against the call a patch is anchored beside, where the code says it.

DiT kinds that run an all-to-all around an attention call (``dit/ulysses_to_heads`` before it,
``dit/ulysses_to_sequence`` after it) state the order of the tensors' dims (``bshd``: batch, sequence, heads,
head_dim; ``bhsd``: batch, heads, sequence, head_dim). Known attention functions fix their layout
(``dispatch_attention_fn`` takes and returns ``bshd``, ``scaled_dot_product_attention`` ``bhsd``), and upstream
sometimes transposes its tensors inline, in the call (Cosmos: ``dispatch_attention_fn(query.transpose(1, 2), ...)``
with ``query`` in ``bhsd``). A template declares which var states the layout and which names the tensors
(``[attention_call]`` in its front matter); when the anchored statement calls a known function with those tensors as
plain names or through transposes this module can read, a statement that contradicts the code is refused at regen in
one line. Anything else is left to the run-time check (``runtime/diffusion/sp_layout.py``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

CALLEES = {"dispatch_attention_fn": "bshd", "scaled_dot_product_attention": "bhsd"}  # by the call's last name
SWAPPED = {"bshd": "bhsd", "bhsd": "bshd"}
WORDS = {"bshd": "(batch, seq, heads, dim)", "bhsd": "(batch, heads, seq, dim)"}
SAME = "same"  # a result var's value: the layout the call's tensors had before it (the heads patch's statement)
_KEEPS_LAYOUT = {"contiguous", "to", "type_as", "float", "half", "bfloat16", "double", "clone"}
_ARGUMENTS = ("query", "key", "value")


@dataclass(frozen=True)
class AttentionCall:
    """A template's ``[attention_call]``: ``dims`` (the var stating the layout), ``tensors`` (the var naming the
    call's query/key/value, or the name its result is assigned to) and ``side`` (``arguments`` or ``result``)."""

    dims: str
    tensors: str
    side: str


def _callee(call: ast.Call) -> str | None:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return name if name in CALLEES else None


def _peel(expr: ast.expr) -> tuple[ast.expr, bool] | None:
    """(the expression under a chain of layout methods, whether the chain swaps heads and sequence); None when a
    method of the chain is one whose effect on the layout is not read here."""
    swapped = False
    while isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and _callee(expr) is None:
        try:
            args = [ast.literal_eval(a) for a in expr.args]
        except ValueError:
            return None
        method = expr.func.attr
        if method == "transpose" and sorted(args) in ([1, 2], [-3, -2]):
            swapped = not swapped
        elif method == "permute" and args in ([0, 2, 1, 3], [[0, 2, 1, 3]], [(0, 2, 1, 3)]):
            swapped = not swapped
        elif method not in _KEEPS_LAYOUT:
            return None
        expr = expr.func.value
    return expr, swapped


def _passed(call: ast.Call) -> list[tuple[str, ast.expr]]:
    """(query/key/value, the argument expression) of an attention call."""
    out = list(zip(_ARGUMENTS, call.args[:3], strict=False))
    out += [(k.arg, k.value) for k in call.keywords if k.arg in _ARGUMENTS]
    return out


def _argument_layouts(call: ast.Call, names: list[str]) -> list[tuple[str, str, str]]:
    """(tensor name, its layout as the call's code implies it, the argument's source) for each tensor among
    ``names`` the call passes as a plain name or through a readable transpose."""
    layout = CALLEES[_callee(call)]
    out = []
    for _, expr in _passed(call):
        peeled = _peel(expr)
        if peeled is not None and isinstance(peeled[0], ast.Name) and peeled[0].id in names:
            out.append((peeled[0].id, SWAPPED[layout] if peeled[1] else layout, ast.unparse(expr)))
    return out


def attention_call_problem(statement: str, check: AttentionCall, values: dict[str, object]) -> str | None:
    """What is wrong with the stated layout for the anchored ``statement`` (its source), or None when it fits or
    the code does not say."""
    try:
        [node] = ast.parse(statement.strip()).body
    except (SyntaxError, ValueError):
        return None
    stated, tensors = values.get(check.dims), values.get(check.tensors)
    names = [t for t in (tensors if isinstance(tensors, list) else [tensors]) if isinstance(t, str)]
    if check.side == "arguments":
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call) and _callee(n)):
            callee = _callee(call)
            for name, implied, source in _argument_layouts(call, names):
                if implied != stated:
                    return (
                        f"vars.{check.dims} = {stated!r} says {name} is {WORDS[stated]}, but the attention call it "
                        f"is anchored beside passes `{source}` to {callee}, which takes {WORDS[CALLEES[callee]]}: "
                        f"{name} is {WORDS[implied]} here; state {check.dims} = {implied!r}"
                    )
        return None
    if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
        return None
    if node.targets[0].id not in names:
        return None
    peeled = _peel(node.value)
    if peeled is None or not isinstance(peeled[0], ast.Call) or _callee(peeled[0]) is None:
        return None
    call = peeled[0]
    result = SWAPPED[CALLEES[_callee(call)]] if peeled[1] else CALLEES[_callee(call)]
    if stated != SAME:
        if stated == result:
            return None
        return (
            f"vars.{check.dims} = {stated!r} says {node.targets[0].id} is {WORDS[stated]}, but the statement it is "
            f"anchored after assigns it the result of {_callee(call)} ({ast.unparse(node.value)[:60]}), which is "
            f"{WORDS[result]}; state {check.dims} = {result!r}"
        )
    before = {implied for _, implied, _ in _argument_layouts(call, _tensor_names(call))}
    if len(before) == 1 and result not in before:
        return (
            f"vars.{check.dims} = {SAME!r} (the layout the tensors had before the call), but the call transposes "
            f"them inline: they are {WORDS[before.pop()]} before it and its result {node.targets[0].id} is "
            f"{WORDS[result]}; state {check.dims} = {result!r}"
        )
    return None


def _tensor_names(call: ast.Call) -> list[str]:
    """The plain names under the call's query/key/value arguments."""
    out = []
    for _, expr in _passed(call):
        peeled = _peel(expr)
        if peeled is not None and isinstance(peeled[0], ast.Name):
            out.append(peeled[0].id)
    return out
