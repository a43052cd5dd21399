"""The code the fixture templates fx/insert_code and fx/replace_code can render, by name.

Spec values are never code, so an engine test picks a snippet by name (a `word` var) and the template holds the code.
`write_code_templates` writes both templates from this table; tests/fixtures/templates/fx/ holds the result and a
test checks the two agree.
"""

from __future__ import annotations

from pathlib import Path

CODE = {
    "nothing": "pass",
    "probe": "probe = 1",
    "residual_zero": "residual = 0",
    "hidden_list": "hidden = list(hidden)",
    "labels_list": "labels = list(labels) if labels else labels",
    "labels_const": "LABELS = 'labels'",
    "norm_default": "norm = norm or 1.0",
    "super_forward": "out, loss = super().forward(hidden), None",
    "return_rescaled": "return rescale(hidden)",
    "one_for_two": "# one statement for two\nresidual = hidden = rescale(hidden)",
    "forward_def": "def forward(self, hidden, attention_mask=None):\n    return hidden",
    "helper_def": "def helper():\n    return 1",
    "commented": "# leading comment\nw = 2  # trailing comment\n# comment between\nv = 3",
}
# The property tests' snippets: every statement shape (compound, multi-line, comments) an insert/replace may carry.
SNIPPETS = [
    "probe = 1",
    "print('probe')  # with a trailing comment",
    "probe_a = 1\nprobe_b = (\n    probe_a,\n    2,\n)",
    "if LIMIT:\n    probe = [\n        1,\n        2,\n    ]\nelse:\n    probe = None",
    "for _probe in range(2):\n    pass",
    "# a leading comment\nprobe = {'k': 1}",
    "try:\n    probe = 1\nexcept Exception:  # broad\n    probe = 2",
]
CODE.update({f"snippet_{i}": text for i, text in enumerate(SNIPPETS)})


def code_template(op: str) -> str:
    """The text of fx/<op>_code: a `code` word var choosing one CODE entry."""
    choices = ", ".join(f'"{name}"' for name in CODE)
    lines = [
        "{#",
        f'op = "{op}"',
        f'doc = "{op.capitalize()} one of the named fixture snippets (tests/engine/snippets.py)."',
        *(
            ['reimplements = ["*"]  # a generic test template: the spec picks the snippet, whatever it replaces']
            * (op == "replace")
        ),
        "",
        "[vars.code]",
        'kind = "word"',
        f"choices = [{choices}]",
        'doc = "which snippet"',
        "#}",
    ]
    branches = [
        f'{{% {"if" if i == 0 else "elif"} code == "{name}" %}}\n{text}\n'
        for i, (name, text) in enumerate(CODE.items())
    ]
    return "\n".join(lines) + "\n" + "".join(branches) + "{% endif %}"


def write_code_templates(directory: Path) -> None:
    for op in ("insert", "replace"):
        (directory / f"{op}_code.py.j2").write_text(code_template(op), encoding="utf-8")


if __name__ == "__main__":  # regenerate the checked-in fixture templates
    write_code_templates(Path(__file__).resolve().parents[1] / "fixtures" / "templates" / "fx")
