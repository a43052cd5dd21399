"""The provenance header of a generated file: what it was made from, as hashes a check can verify cheaply."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

BEGIN = "# ---- patchgen provenance (generated file: do not edit) ----"
END = "# ---- end of patchgen provenance ----"


@dataclass(frozen=True)
class Header:
    model: str
    upstream_pin: str  # transformers==5.14.1
    upstream_path: str
    upstream_sha256: str
    spec_path: str
    spec_sha256: str
    templates_sha256: str
    engine_version: str
    engine_sha256: str
    body_sha256: str
    patches: tuple[str, ...]  # "#1 sp/rope_slice @ Qwen3Model.forward: why"

    def inputs(self) -> tuple[str, ...]:
        """Everything the output is a function of; equal inputs + equal body hash => no drift."""
        return (
            self.upstream_pin,
            self.upstream_sha256,
            self.spec_sha256,
            self.templates_sha256,
            self.engine_version,
            self.engine_sha256,
        )

    def render(self) -> str:
        lines = [
            BEGIN,
            f"# Made by patchgen {self.engine_version} from {self.spec_path}; to change it, edit the spec or a",
            f"# template and run `patchgen regen {self.model}`. `patchgen check` fails when this file drifts.",
            f"# upstream: {self.upstream_pin} {self.upstream_path} sha256={self.upstream_sha256}",
            f"# spec: {self.spec_path} sha256={self.spec_sha256}",
            f"# templates: sha256={self.templates_sha256}",
            f"# engine: patchgen=={self.engine_version} sha256={self.engine_sha256}",
            f"# body: sha256={self.body_sha256}",
            "# patches:",
            *(f"#   {p}" for p in self.patches),
            END,
        ]
        return "\n".join(lines) + "\n"


def body_hash(body: str) -> str:
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def split(text: str) -> tuple[dict[str, str] | None, str]:
    """(fields, body) of a generated file; fields is None when the file has no well-formed header."""
    if not text.startswith(BEGIN + "\n") or ("\n" + END + "\n") not in text:
        return None, text
    head, body = text.split("\n" + END + "\n", 1)
    fields: dict[str, str] = {}
    for line in head.splitlines()[1:]:
        key, _, value = line[2:].partition(": ")
        if key in ("upstream", "spec", "templates", "engine", "body"):
            fields[key] = value
    return fields, body


def parse_inputs(fields: dict[str, str]) -> tuple[str, ...] | None:
    """The same tuple as Header.inputs(), read back from header fields."""
    try:
        pin, _, upstream_sha = fields["upstream"].split(" ")
        engine_version, engine_sha = fields["engine"].split(" ")
        return (
            pin,
            upstream_sha.removeprefix("sha256="),
            fields["spec"].split(" sha256=")[1],
            fields["templates"].removeprefix("sha256="),
            engine_version.removeprefix("patchgen=="),
            engine_sha.removeprefix("sha256="),
        )
    except (KeyError, ValueError, IndexError):
        return None
