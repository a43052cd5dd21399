"""How many shipped specs `patchgen draft` reproduces: for each, in a scratch copy of the project without that spec,
draft it (a DiT from its diffusers class, named as the shipped spec; a VLM as a member of a shipped family), generate,
and compare with the committed generated files: the code (every generated module's body, the header aside: it hashes
the spec's bytes and quotes each patch's `why`) and the model record (`.model.json`).

`python -m patchgen.draft.reproduce [spec ...]` prints one line per spec and the count; exit 0.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from patchgen.config import ProjectConfig, load_config
from patchgen.draft.loading import load_drafted
from patchgen.draft.pipeline import draft_spec, drafted_from
from patchgen.errors import PatchgenError
from patchgen.header import split
from patchgen.ownership import model_record
from patchgen.upstream import PinnedSource, UpstreamSource

# a patch's marker comment in generated code: `# patchgen #3 sp/rope_slice (1 stmt): <why>`
MARKER_WHY = re.compile(r"^(\s*# patchgen #\d+ \S+ \([^)]*\)):.*$", re.MULTILINE)

# why a shipped spec is not reproduced (docs/adding-a-model.md, What draft reproduces): hand choices a rule would
# not make, and what draft does not read yet. tests/engine/test_draft.py holds the code-equal ones to their record.
NOT_REPRODUCED = {
    "mimo_v2_flash": "hand choice: the shipped tiny config puts the full-attention layer first, gives each layer type "
    "its own RoPE theta and leaves grouped routing at its defaults (draft's rule: 2 groups, scale 1.5)",
    "qwen2_vl": "a VLM of its own structure: draft writes a VLM only as a member of a shipped VLM family (extends)",
    "qwen2_5_vl": "a VLM of its own structure: draft writes a VLM only as a member of a shipped VLM family (extends)",
    "qwen3_vl": "a VLM of its own structure: draft writes a VLM only as a member of a shipped VLM family (extends)",
    "qwen3_omni_moe": "an omni model (thinker): draft reads decoder LMs (vision and audio kinds not recognised yet)",
    "qwen3_omni_moe_processor": "a processor spec, not a model: outside draft",
}
# a DiT's record is fitted to its hand-written condition model (runtime/diffusion/conditions/): the tiny config to
# the tiny pipeline's widths, the data (released checkpoints, tiny variants) to what no upstream text states
_FITTED = "code reproduced; the record's tiny config and data are fitted to the hand-written condition model"
NOT_REPRODUCED |= {
    name: _FITTED
    for name in ("wan", "flux", "qwenimage", "ltx_video", "cogvideox", "auraflow", "hunyuanvideo", "lumina2", "sd3")
}
NOT_REPRODUCED["sana"] = (
    "its self-attention processor (SanaLinearAttnProcessor2_0, diffusers' shared module) is linear attention, no "
    "softmax call: [model.unsupported] sp naming it; the shipped kinds for it (whole grid rows, the conv's halo rows, "
    "the key-value all-reduce) are hand-written"
)
NOT_REPRODUCED["pixart_sigma"] = (
    "its blocks (BasicTransformerBlock) build no processor (diffusers' Attention picks AttnProcessor2_0 for self- and "
    "cross-attention alike): [model.unsupported] sp naming it; hand choices: the split handed to the self-attention "
    "only, GLIGEN's gated attention refused, the gather listed before the block patches"
)
NOT_REPRODUCED["skyreels_v2"] = (
    "every SP patch drafted as shipped (the grid RoPE split, per-frame temb and timestep_proj sliced after their "
    "repeat, the block-causal mask refused); hand choice: no [model] record (no condition model here: draft's "
    "record would name one that does not exist), so no training shell"
)
NOT_REPRODUCED["qwen3_next"] = (
    "code reproduced (gated delta-net layers split by the sp/linear_attention kinds); hand choice: the shipped tiny "
    "config has a shared expert 32 wide (draft's rule: 48)"
)
NOT_REPRODUCED["llama4_text"] = (
    "code reproduced; hand choice: the shipped tiny config is set past every threshold of its position-dependent "
    "attention (chunks of 8, NoPE layer, temperature floor_scale 4, MoE on layer 1 only: no rule reads thresholds "
    "from upstream) and its ep reason is worded by hand (draft states it from the experts' missing "
    "use_experts_implementation)"
)


@dataclass(frozen=True)
class Outcome:
    spec: str
    code_equal: bool  # every generated module's body equal but for the patches' `why` quoted in its markers
    record_equal: bool
    why_equal: bool  # the markers' `why` prose too (a hand-written sentence draft words its own way)
    seconds: float
    why: str  # empty when both are equal

    @property
    def equal(self) -> bool:
        return self.code_equal and self.record_equal


def scratch_project(config: ProjectConfig, folder: Path, without: str) -> ProjectConfig:
    """pyproject.toml, specs/ (less `without`) and templates/ copied to `folder`, runtime/ linked (where a DiT's
    condition model is looked for): generated/ is read from the real project, nothing is written there."""
    shutil.copy2(config.root / "pyproject.toml", folder / "pyproject.toml")
    (folder / "runtime").symlink_to(config.root / "runtime", target_is_directory=True)
    shutil.copytree(config.specs_dir, folder / "specs")
    shutil.copytree(config.templates_dir, folder / "templates")
    (folder / "specs" / f"{without}.toml").unlink()
    return load_config(folder)


def reproduce(config: ProjectConfig, name: str, source: UpstreamSource) -> Outcome:
    """Draft `name` in a scratch project that lacks its spec, generate, compare with the committed files."""
    from patchgen.generate import generate

    started = time.perf_counter()
    committed = tomllib.loads(config.spec_path(name).read_text(encoding="utf-8"))
    argument, dit = drafted_from(committed, name)  # a DiT is drafted from its class, named as the shipped spec
    with tempfile.TemporaryDirectory(prefix="patchgen-reproduce-") as folder:
        scratch = scratch_project(config, Path(folder), name)
        try:
            drafted = draft_spec(argument, source, scratch.pins, name if dit else None, scratch)
            spec = load_drafted(scratch, name, drafted.text)
            generated = generate(spec, source, scratch)
        except PatchgenError as exc:
            return Outcome(name, False, False, False, time.perf_counter() - started, str(exc).splitlines()[0])
        reasons = []
        code_equal = why_equal = True
        for one in generated.files:
            old = config.root / one.relpath
            old_body = split(old.read_text(encoding="utf-8"))[1] if old.is_file() else ""
            new_body = split(one.text)[1]
            why_equal = why_equal and old_body == new_body
            if MARKER_WHY.sub(r"\1", old_body) != MARKER_WHY.sub(r"\1", new_body):
                code_equal = False
                reasons.append(f"{one.relpath} differs")
        record_equal = True
        sidecar = (config.root / spec.output.removesuffix(".py")).with_suffix(".model.json")
        if spec.model is not None and not sidecar.is_file():  # the shipped spec states no [model] record
            record_equal = False
            reasons.append("record: drafted only (the shipped spec states no [model])")
        elif spec.model is not None:
            old_record = json.loads(sidecar.read_text(encoding="utf-8"))
            new_record = json.loads(model_record(spec))
            keys = sorted(k for k in old_record.keys() | new_record.keys() if old_record.get(k) != new_record.get(k))
            record_equal = not keys
            for k in keys:
                reasons.append(f"record {k}: {_delta(old_record.get(k), new_record.get(k))}")
    if code_equal and not why_equal:
        reasons.append("only the patches' why in the markers differs")
    seconds = time.perf_counter() - started
    return Outcome(name, code_equal, record_equal, why_equal, seconds, "; ".join(reasons))


def _delta(old: object, new: object) -> str:
    """What differs in one record key: the differing sub-keys of a table, else both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        parts = []
        for k in sorted(old.keys() | new.keys()):
            if old.get(k) != new.get(k):
                parts.append(
                    f"{k} {old.get(k, '-')!r} -> {new.get(k, '-')!r}"
                    if k in old and k in new
                    else f"{k} only {'shipped' if k in old else 'drafted'}"
                )
        return ", ".join(parts)
    return f"{old!r} -> {new!r}"


def main(argv: list[str]) -> int:
    config = load_config()
    source = PinnedSource(config.pins)
    names = argv or config.models()
    outcomes = []
    for name in names:
        outcome = reproduce(config, name, source)
        outcomes.append(outcome)
        state = "EQUAL" if outcome.equal else "code equal" if outcome.code_equal else "DIFFERS"
        known = f" [{NOT_REPRODUCED[name]}]" if name in NOT_REPRODUCED and not outcome.equal else ""
        print(f"{name:<28} {state:<10} {outcome.seconds:5.1f} s  {outcome.why}{known}", flush=True)
    byte = [o.spec for o in outcomes if o.equal and o.why_equal]
    equal = [o.spec for o in outcomes if o.equal]
    code = [o.spec for o in outcomes if o.code_equal]
    print(
        f"{len(equal)} of {len(outcomes)} equal (code but the markers' why, and record; {len(byte)} byte for byte); "
        f"{len(code)} of {len(outcomes)} with equal code"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
