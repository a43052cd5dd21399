"""A DiT's token layout read from its forward where diffusers states no context-parallel plan (`_cp_plan`): the
plan diffusers would state, recognised structurally, so the DiT kinds are placed by the same rules as for a class
that states one. The patchified tokens are `hidden_states` (split over dim 1); the RoPE tables' positions are the
forward's inputs that the one RoPE call concatenates (`ids = torch.cat((txt_ids, img_ids), dim=0)`: split where
they are joined); the output gathered is the forward's last `x = self.<linear>(...)` (or of a norm built with an
`out_dim`), the output projection before unpatchify. What cannot be placed is a reason naming file:line, never a
guess."""

from __future__ import annotations

import libcst as cst

from patchgen.cst.locate import code_of, normalize
from patchgen.draft.recognised import Found
from patchgen.draft.structure import Module, dotted, nodes

LINEAR = ("nn.Linear", "torch.nn.Linear")


def assign_of(stmt: cst.CSTNode) -> tuple[str | None, cst.BaseExpression | None]:
    """(target name, value) of a one-target simple assignment statement, else (None, None)."""
    if isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Assign):
        assign = stmt.body[0]
        if len(assign.targets) == 1 and isinstance(assign.targets[0].target, cst.Name):
            return assign.targets[0].target.value, assign.value
    return None, None


def canonical(node: cst.CSTNode, mode: str = "exec") -> str:
    """The canonical one-line text of a statement or expression (comments and layout dropped): an anchor."""
    return normalize(code_of(node).strip() if mode == "eval" else code_of(node), mode) or code_of(node).strip()


def self_call(value: cst.BaseExpression | None) -> str | None:
    """`attr` of a value `self.attr(...)`."""
    if isinstance(value, cst.Call) and (dotted(value.func) or "").startswith("self."):
        name = dotted(value.func)[5:]
        return name if "." not in name else None
    return None


def init_call(mod: Module, cls: str, attr: str | None) -> str | None:
    """The callee of `self.attr = <callee>(...)` in `cls.__init__` (e.g. nn.Linear)."""
    for node in nodes(mod.method(cls, "__init__"), lambda n: isinstance(n, cst.Assign)):
        if dotted(node.targets[0].target) == f"self.{attr}" and isinstance(node.value, cst.Call):
            return dotted(node.value.func)
    return None


def projects(mod: Module, cls: str, attr: str) -> bool:
    """Whether `self.attr` is built with an `out_dim=` of its own: a final norm that also projects the tokens to the
    patch's channels (Lumina2's `LuminaLayerNormContinuous(..., out_dim=p * p * out_channels)`)."""
    for node in nodes(mod.method(cls, "__init__"), lambda n: isinstance(n, cst.Assign)):
        if dotted(node.targets[0].target) == f"self.{attr}" and isinstance(node.value, cst.Call):
            return any(a.keyword is not None and a.keyword.value == "out_dim" for a in node.value.args)
    return False


def layout_plan(mod: Module, cls: str, rope: int | None) -> tuple[list[tuple[str, object, str, dict]], str | None]:
    """The plan's leaves (module, input, kind, keywords) as `_cp_plan` would state them, and '' or the reason
    (file:line) why the output cannot be placed. `rope`: the index of the forward's one RoPE statement, if any."""
    forward = mod.method(cls, "forward")
    body = list(forward.body.body)
    params = {p.name.value for p in forward.params.params}
    entries: list[tuple[str, object, str, dict]] = [
        ("", "hidden_states", "ContextParallelInput", {"split_dim": 1, "expected_dims": 3})
    ]
    if rope is not None:
        for name, dim in _joined_positions(body, rope, params):
            entries.append(("", name, "ContextParallelInput", {"split_dim": dim, "expected_dims": 2}))
    linear = [
        (attr, s)
        for s in body
        if (attr := self_call(assign_of(s)[1])) is not None
        and (init_call(mod, cls, attr) in LINEAR or projects(mod, cls, attr))
    ]
    if not linear:
        return entries, f"{cls}.forward ({mod.where(forward)}) assigns no `x = self.<nn.Linear>(...)` to gather"
    entries.append((linear[-1][0], None, "ContextParallelOutput", {"gather_dim": 1, "expected_dims": 3}))
    return entries, None


def _joined_positions(body: list[cst.CSTNode], rope: int, params: set[str]) -> list[tuple[str, int]]:
    """(input, dim) of the forward's inputs that `ids = torch.cat((a, b), dim=d)` joins for the RoPE call
    `self.<rope>(ids)`; [] when the RoPE is computed from anything else."""
    call = assign_of(body[rope])[1]
    args = [a for a in call.args if a.keyword is None] if isinstance(call, cst.Call) else []
    if len(args) != 1 or not isinstance(args[0].value, cst.Name):
        return []
    source = next((assign_of(s)[1] for s in body[:rope] if assign_of(s)[0] == args[0].value.value), None)
    if not (isinstance(source, cst.Call) and dotted(source.func) == "torch.cat" and source.args):
        return []
    dims = [a.value for a in source.args[1:] if a.keyword is None or a.keyword.value == "dim"]
    dim = int(dims[0].value) if dims and isinstance(dims[0], cst.Integer) else 0 if not dims else None
    parts = source.args[0].value
    names = [dotted(e.value) for e in parts.elements] if isinstance(parts, cst.Tuple | cst.List) else []
    if dim is None or not names or not all(n in params for n in names):
        return []
    return [(n, dim) for n in names]


def per_token_timestep(body: list[cst.CSTNode]) -> cst.CSTNode | None:
    """The statement that embeds `timestep.flatten()` when a later one views that embedding back as `(batch, -1,
    width)`: one timestep per token where the input's second dim is longer than 1 (LTX-Video), one per sample
    where it is 1. None when the forward does not."""
    for i, stmt in enumerate(body):
        flat = nodes(
            stmt, lambda n: isinstance(n, cst.Arg) and normalize(code_of(n.value), "eval") == "timestep.flatten()"
        )
        if not flat or not isinstance(stmt, cst.SimpleStatementLine) or not isinstance(stmt.body[0], cst.Assign):
            continue
        target = stmt.body[0].targets[0].target
        names = [dotted(e.value) for e in target.elements] if isinstance(target, cst.Tuple) else [dotted(target)]
        for later in body[i + 1 :]:
            name, value = assign_of(later)
            if name in names and isinstance(value, cst.Call) and dotted(value.func) == f"{name}.view":
                args = [normalize(code_of(a.value), "eval") for a in value.args]
                if len(args) == 3 and args[1] == "-1":
                    return stmt
    return None


def grid_rotary_dim(mod: Module, rope_cls: str) -> int | None:
    """The token dim of the tables a RoPE module builds from the latent grid (SkyReels-V2: `freqs_cos = ...reshape(1,
    ppf * pph * ppw, 1, -1)`): the one place of the patch grid's product in the reshape of every table it returns.
    None when its forward returns anything else."""
    forward = mod.method(rope_cls, "forward")
    returns = nodes(forward, lambda n: isinstance(n, cst.Return))
    if len(returns) != 1 or returns[0].value is None:
        return None
    value = returns[0].value
    names = [dotted(e.value) for e in value.elements] if isinstance(value, cst.Tuple) else [dotted(value)]
    body = list(forward.body.body)
    dims = set()
    for name in names:
        last = [v for s in body if (a := assign_of(s))[0] == name and (v := a[1]) is not None]
        call = last[-1] if last else None
        reshape = method_call(call, "reshape")
        if reshape is None:
            return None
        grid = [i for i, a in enumerate(reshape.args) if grid_product(a.value)]
        if len(grid) != 1:
            return None
        dims.add(grid[0])
    return dims.pop() if len(dims) == 1 else None


def grid_product(node: cst.BaseExpression) -> bool:
    """`a * b * c`: a product of two or more names (a token count over the patch grid)."""
    if not isinstance(node, cst.BinaryOperation) or not isinstance(node.operator, cst.Multiply):
        return False
    return all(isinstance(side, cst.Name) or grid_product(side) for side in (node.left, node.right))


def method_call(value: cst.BaseExpression | None, name: str) -> cst.Call | None:
    """`value` when it is a call `<...>.name(...)`."""
    if isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value == name:
        return value
    return None


def gather_found(scope: str, tensor: str, anchor: str, note: str) -> Found:
    """The output's gather (``dit/gather_tokens``) after the statement ``anchor`` that assigns ``tensor``: one patch
    for every DiT layout draft reads, whichever rule found the output."""
    why = "gather the projected tokens and drop the padding before unpatchify"
    return Found("dit/gather_tokens", scope, why, note, vars={"tensor": tensor}, anchor=anchor, place="after")
