"""`add_parameter`: the function or method the scope names gains one parameter with a default.

The template renders the parameter (`name=default`). It goes last among the named parameters: before `**kwargs`,
and keyword-only when the signature has `*` or `*args` (then no positional call changes meaning). A name the
signature already has (`*args` and `**kwargs` included) is a conflict. Why: a caller that passes only the keyword
arguments a callee's signature names (diffusers' `Attention.forward` filters a processor's kwargs by its `__call__`
signature) reaches new code only through a new parameter.
"""

from __future__ import annotations

from patchgen.ops.base import (
    CONFLICT,
    RENDER_ERROR,
    SCOPE_MISMATCH,
    Edit,
    Op,
    PlanError,
    ResolveContext,
    cst,
    marker_text,
    patch_label,
)


class AddParameter(Op):
    name = "add_parameter"

    def resolve(self, ctx: ResolveContext) -> None:
        patch = ctx.patch
        scope = ctx.scope_node()
        if not isinstance(scope, cst.FunctionDef):
            raise PlanError(
                patch,
                f"op add_parameter needs a function or method scope, {patch.scope!r} is not one",
                kind=SCOPE_MISMATCH,
            )
        param = rendered_parameter(ctx.render(), patch)
        name = param.name.value
        params = scope.params
        existing = [p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)]
        existing += [p.name.value for p in (params.star_arg, params.star_kwarg) if isinstance(p, cst.Param)]
        if name in existing:
            raise PlanError(patch, f"{patch.scope} already has a parameter named {name!r}", kind=CONFLICT)
        ctx.add(Edit(patch, self, scope, name))

    def apply_in_place(self, edit: Edit, node, rewrite):
        rewrite.count(edit)
        param = rendered_parameter(edit.patch.template.render(edit.patch.vars, _site(edit)), edit.patch)
        params = node.params
        keyword_only = isinstance(params.star_arg, cst.Param | cst.ParamStar)  # `*args` or a bare `*`
        field = "kwonly_params" if keyword_only else "params"
        params = params.with_changes(**{field: [*getattr(params, field), param]})
        params = _laid_out(params, field, node.whitespace_before_params)
        marker = cst.EmptyLine(comment=cst.Comment(marker_text(patch_label(edit.patch), 1, edit.patch.why)))
        return node.with_changes(params=params, leading_lines=[*node.leading_lines, marker])


def _laid_out(params, field: str, opening) -> object:
    """The signature's own layout for the parameter just appended to `field`: it takes the comma (and the line
    break) of the element before it; when it is the last element, that one takes the separator before it."""
    order = ["posonly_params", "posonly_ind", "params", "star_arg", "kwonly_params", "star_kwarg"]
    slots = [
        (name, index, element)
        for name in order
        for index, element in (
            enumerate(getattr(params, name))
            if isinstance(getattr(params, name), list | tuple)
            else [(None, getattr(params, name))]
        )
        if isinstance(element, cst.Param | cst.ParamStar | cst.ParamSlash)
    ]
    position = max(i for i, (name, _, _) in enumerate(slots) if name == field)
    if position == 0:
        return params
    new, previous = slots[position][2], slots[position - 1]
    params = _replace(params, slots[position], new.with_changes(comma=previous[2].comma))
    if position == len(slots) - 1 and previous[2].comma != cst.MaybeSentinel.DEFAULT:
        if position >= 2:
            separator = slots[position - 2][2].comma
        elif isinstance(opening, cst.ParenthesizedWhitespace):
            separator = cst.Comma(whitespace_after=opening)
        else:
            separator = cst.MaybeSentinel.DEFAULT
        params = _replace(params, previous, previous[2].with_changes(comma=separator))
    return params


def _replace(params, slot, element):
    name, index, _ = slot
    if index is None:
        return params.with_changes(**{name: element})
    items = list(getattr(params, name))
    items[index] = element
    return params.with_changes(**{name: items})


def _site(edit: Edit) -> dict[str, str]:
    patch = edit.patch
    return {"scope": patch.scope, "spec": patch.source, "patch": str(patch.index)}


def rendered_parameter(code: str, patch) -> cst.Param:
    """The one parameter with a default that the template renders (`name=default`)."""
    try:
        params = cst.parse_expression(f"lambda {code.strip()}: None").params
    except cst.ParserSyntaxError:
        params = None
    named = [*params.params, *params.kwonly_params] if params is not None else []
    if params is None or len(named) != 1 or params.star_arg != cst.MaybeSentinel.DEFAULT or params.star_kwarg:
        raise PlanError(
            patch, f"rendered add_parameter is not one parameter `name=default`: {code.strip()!r}", kind=RENDER_ERROR
        )
    if named[0].default is None:
        raise PlanError(patch, f"the added parameter needs a default value, found {code.strip()!r}", kind=RENDER_ERROR)
    none = cst.SimpleWhitespace("")
    return cst.Param(
        name=named[0].name,
        default=named[0].default,
        equal=cst.AssignEqual(whitespace_before=none, whitespace_after=none),
    )


OP = AddParameter()
