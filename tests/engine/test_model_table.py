"""One spec is one model (issue 11 E): the `[model]` table, its sidecar record, and `extends` + `class_prefix`."""

from __future__ import annotations

import json
import shutil

import pytest

from patchgen.errors import PatchgenError
from patchgen.model import derive_supports
from patchgen.project import check, regen
from tests.engine.helpers import ALL_OPS, REPO, TOY, FixtureSource, body_of, spec_toml, upstream_text

MODEL = """
[model]
model_type = "toy"
class = "ToyForTask"
upstream = "fixturepkg.AutoToy"
family = "causal_lm"
capabilities = ["moe"]

[model.tiny]
hidden_size = 8
sub = { depth = 2, names = ["a", "b"] }

[model.data]
processor = "ToyProcessor"
"""
BIG = "fixturepkg.models.modeling_bigtoy"  # the toy module with every `Toy` renamed `BigToy`
SOURCE = FixtureSource(overrides={BIG: upstream_text(TOY).replace("Toy", "BigToy")})


def with_model(text: str, table: str = MODEL) -> str:
    head, sep, rest = text.partition("\n[[patch]]")
    return head + table + sep + rest


def test_regen_writes_the_model_record_beside_the_output_and_check_guards_it(project) -> None:
    proj = project(with_model(spec_toml(patches=ALL_OPS[:2])))
    regen(proj.config, [proj.spec()], source=FixtureSource())
    record = proj.root / "generated/toy/modeling_toy.model.json"
    assert json.loads(record.read_text()) == {
        "spec": "toy",
        "module": "generated.toy.modeling_toy",
        "model_type": "toy",
        "class": "ToyForTask",
        "upstream": "fixturepkg.AutoToy",
        "family": "causal_lm",
        "capabilities": ["moe"],
        "tiny": {"hidden_size": 8, "sub": {"depth": 2, "names": ["a", "b"]}},
        "data": {"processor": "ToyProcessor"},
        "supports": {
            "sp": False,
            "ring": False,
            "ep": False,
            "attention_sites": [],
            "replicated_modules": [],
            "handles": [],
        },
    }
    assert check(proj.config, [proj.spec()], source=FixtureSource()) == []
    record.write_text(record.read_text().replace('"hidden_size": 8', '"hidden_size": 9'))
    [drift] = check(proj.config, [proj.spec()], source=FixtureSource())
    assert drift.path == record and "model record missing or stale" in drift.reason


@pytest.mark.parametrize(
    "table, message",
    [
        ('[model]\nmodel_type = "toy"\nclass = "ToyForTask"\nupstream = "x.Y"\n', "[model] is missing 'family'"),
        (MODEL.replace('family = "causal_lm"', 'family = "llm"'), "key 'family' must be one of"),
        (MODEL.replace('["moe"]', '["mole"]'), "key 'capabilities' must be an array of distinct capabilities"),
        (MODEL.replace('upstream = "fixturepkg.AutoToy"', 'upstream = "AutoToy"'), "key 'upstream' must be a dotted"),
        (MODEL.replace('family = "causal_lm"', 'family = "causal_lm"\ncolour = "red"'), "unknown key 'colour'"),
        (MODEL.replace('model_type = "toy"', 'model_type = "toy-2"'), "key 'model_type' must be a Python name"),
        (MODEL.replace('["moe"]', '["moe"]\nhandles = ["attention_sinks"]'), "key 'handles' must be an array of"),
        (MODEL.replace('["moe"]', '["moe"]\nhandles = "final_logit_softcapping"'), "key 'handles' must be an array"),
        (
            MODEL.replace('["moe"]', '["moe"]\nhandles = ["final_logit_softcapping", "final_logit_softcapping"]'),
            "key 'handles' must be an array of distinct config options",
        ),
    ],
)
def test_a_bad_model_table_names_the_file_and_key(project, table: str, message: str) -> None:
    proj = project(with_model(spec_toml(), table))
    with pytest.raises(PatchgenError) as err:
        proj.spec()
    assert str(err.value).startswith(str(proj.root / "specs" / "toy.toml"))
    assert message in str(err.value)


CHILD = f"""extends = "toy"
class_prefix = {{ from = "Toy", to = "BigToy" }}
module = "{BIG}"
output = "generated/bigtoy/modeling_bigtoy.py"

[model]
model_type = "bigtoy"
capabilities = []

[model.tiny]
sub = {{ depth = 3 }}
"""


def test_extends_inherits_patches_with_class_names_renamed(project) -> None:
    proj = project({"toy": with_model(spec_toml(patches=ALL_OPS)), "bigtoy": CHILD})
    base, child = proj.generate("toy"), proj.generate("bigtoy", SOURCE)
    assert [p.scope for p in child.spec.patches] == [p.scope.replace("Toy", "BigToy") for p in base.spec.patches]
    assert child.spec.keep == ("BigToyForTask",)
    assert body_of(child.text) == body_of(base.text).replace("Toy", "BigToy")
    model = child.spec.model
    assert (model.model_type, model.cls, model.capabilities) == ("bigtoy", "BigToyForTask", ())
    assert model.tiny == {"hidden_size": 8, "sub": {"depth": 3, "names": ["a", "b"]}}  # merged table by table


def test_an_extending_spec_appends_its_own_patches_and_tracks_its_base(project) -> None:
    own = '\n[[patch]]\ntemplate = "core/rename"\nscope = "rescale"\nvars = { to = "rescale_big" }\nwhy = "own"\n'
    proj = project({"toy": with_model(spec_toml(patches=ALL_OPS[:2])), "bigtoy": CHILD + own})
    child = proj.spec("bigtoy")
    assert [p.template.name for p in child.patches] == ["fx/insert_trace", "fx/replace_rescale", "core/rename"]
    assert [p.index for p in child.patches] == [1, 2, 3]
    before = child.sha256
    proj.write_spec(with_model(spec_toml(patches=ALL_OPS[:1])), "toy")  # the base changes: so does the child
    assert proj.spec("bigtoy").sha256 != before


@pytest.mark.parametrize(
    "text, message",
    [
        (
            'extends = "nope"\nmodule = "fixturepkg.plain"\noutput = "generated/x.py"\n',
            "'extends' = 'nope': no spec file",
        ),
        (
            'extends = "bigtoy"\nmodule = "fixturepkg.plain"\noutput = "generated/x.py"\n',
            "a spec cannot extend itself",
        ),
        ('extends = "../toy"\nmodule = "fixturepkg.plain"\noutput = "generated/x.py"\n', "must name another spec"),
        (spec_toml() + 'class_prefix = { from = "A", to = "B" }\n', "class_prefix renames what a spec inherits"),
        (CHILD.replace('to = "BigToy"', 'to = "Big Toy"'), "class_prefix must be"),
    ],
)
def test_bad_extends(project, text: str, message: str) -> None:
    proj = project({"toy": with_model(spec_toml()), "bigtoy": text})
    with pytest.raises(PatchgenError, match=message):
        proj.spec("bigtoy")


def test_an_extends_cycle_is_an_error(project) -> None:
    loop = 'extends = "{}"\nmodule = "fixturepkg.plain"\noutput = "generated/{}.py"\n'
    proj = project({"a": loop.format("b", "a"), "b": loop.format("a", "b")})
    with pytest.raises(PatchgenError, match="chain deeper than"):
        proj.spec("a")


def test_a_transformers_model_implies_upstream_conversions(project) -> None:
    table = MODEL.replace('upstream = "fixturepkg.AutoToy"', 'upstream = "transformers.AutoModelForCausalLM"')
    proj = project(with_model(spec_toml(patches=ALL_OPS[:1]), table))
    spec = proj.spec()
    implied = spec.patches[-1]
    assert (implied.index, implied.template.name, implied.scope) == (2, "core/upstream_weight_conversions", "<module>")
    assert implied.vars == {"model_type": "toy"} and implied.why.startswith("implied by [model]")
    assert body_of(proj.generate().text).rstrip().endswith('share_upstream_weight_conversions("toy", __name__)')
    off = table.replace('family = "causal_lm"', 'family = "causal_lm"\nconversions = false')
    assert [p.template.name for p in project(with_model(spec_toml(patches=ALL_OPS[:1]), off)).spec().patches] == [
        "fx/insert_trace"
    ]
    explicit = {"template": "core/upstream_weight_conversions", "scope": "<module>", "vars": {"model_type": "t"}}
    proj = project(with_model(spec_toml(patches=[{**explicit, "why": "x"}]), table))
    with pytest.raises(PatchgenError, match="implies the core/upstream_weight_conversions patch; remove the explicit"):
        proj.spec()


@pytest.mark.parametrize("cls", ["NoSuchClass", "UnusedThing", "rescale"])
def test_the_model_class_must_be_a_class_of_the_generated_module(project, cls: str) -> None:
    proj = project(with_model(spec_toml(), MODEL.replace('class = "ToyForTask"', f'class = "{cls}"')))
    with pytest.raises(PatchgenError, match=rf"\[model\] class '{cls}' is not a kept class of the generated module"):
        proj.generate()


# The SP, ring and EP kinds from the real templates, applied to the toy module (their anchors need only an
# expression of the right scope: the derivation reads which patches the spec applies, not what they compute).
SP_PATCHES = [
    dict(template="sp/ulysses_attention", scope="ToyLayer.forward", anchor="self.config.scale", why="ulysses"),
    dict(
        template="sp/vit_attention_all_to_all",
        scope="ToyModel.forward",
        before="norm = math.sqrt(sum(h * h for h in hidden) + EPS)",
        vars=dict(tensors=["hidden"], to="heads", seq_dim=0, head_dim=1),
        why="a vision tower's all-to-all",
    ),
    dict(template="moe/ep_plan", scope="ToyModel", vars=dict(params=["mlp.experts.w"]), why="EP plan"),
]


def test_supports_is_derived_from_the_applied_patches(project) -> None:
    proj = project(with_model(spec_toml(patches=ALL_OPS[:2]), MODEL))
    for family in ("sp", "moe"):
        shutil.copytree(REPO / "templates" / family, proj.root / "templates" / family)
    regen(proj.config, [proj.spec()], source=FixtureSource())
    record = proj.root / "generated/toy/modeling_toy.model.json"
    without = json.loads(record.read_text())["supports"]
    assert without == {
        "sp": False,
        "ring": False,
        "ep": False,
        "attention_sites": [],
        "replicated_modules": [],
        "handles": [],  # a handled option in the record: tests/models/test_softcap.py (regen proves the claim)
    }
    proj.write_spec(with_model(spec_toml(patches=[ALL_OPS[0], *SP_PATCHES]), MODEL))
    regen(proj.config, [proj.spec()], source=FixtureSource())
    assert json.loads(record.read_text())["supports"] == {
        "sp": True,
        "ring": True,  # the LM Ulysses wrapper runs ring attention itself
        "ep": True,
        "attention_sites": ["ToyLayer.forward", "ToyModel.forward"],
        "replicated_modules": [],
        "handles": [],
    }
    assert check(proj.config, [proj.spec()], source=FixtureSource()) == []


def _dit(*kinds: str, replicated: tuple[list[str], ...] = ()) -> list[tuple[str, str, dict]]:
    site = ("ulysses", "ring", "linear_attention", "local_attention")  # kinds at an attention processor's __call__
    patches = [(kind, "Proc.__call__" if any(s in kind for s in site) else "Model.forward", {}) for kind in kinds]
    return patches + [("dit/shard_tokens", "Model.forward", {"replicated_modules": r}) for r in replicated]


@pytest.mark.parametrize(
    "patches, expected",
    [
        (_dit(), dict(sp=False, ring=False, ep=False, attention_sites=[], replicated_modules=[])),
        (  # a DiT with a token split but no ring attention patch: Ulysses only, a ring would attend locally
            _dit("dit/ulysses_to_heads", replicated=(["refiner"],)),
            dict(sp=True, ring=False, ep=False, attention_sites=["Proc.__call__"], replicated_modules=["refiner"]),
        ),
        (
            _dit("dit/ulysses_to_heads", "dit/ring_attention", replicated=(["b", "a"], ["a"])),
            dict(sp=True, ring=True, ep=False, attention_sites=["Proc.__call__"], replicated_modules=["a", "b"]),
        ),
        (  # Sana: linear attention (all-reduced key-value sums) and a cross-attention to replicated text are exact
            # on a ring with no ring wrapper
            _dit("dit/linear_attention_kv", "dit/local_attention", replicated=([],)),
            dict(sp=True, ring=True, ep=False, attention_sites=["Proc.__call__"], replicated_modules=[]),
        ),
        (  # two head-sharded sites, one of them not wrapped by dit/ring_attention: a ring would attend locally there
            [
                *_dit("dit/ulysses_to_heads", "dit/ring_attention", replicated=([],)),
                ("dit/ulysses_to_heads", "P2.x", {}),
            ],
            dict(sp=True, ring=False, ep=False, attention_sites=["P2.x", "Proc.__call__"], replicated_modules=[]),
        ),
        (  # attention sites without a token split (a ViT all-to-all alone) do not make the model SP-capable
            [("sp/vit_attention_all_to_all", "V.forward", {}), ("sp/vit_attention_all_to_all", "V.forward", {})],
            dict(sp=False, ring=False, ep=False, attention_sites=["V.forward"], replicated_modules=[]),
        ),
    ],
)
def test_supports_of_dit_patch_sets(patches: list, expected: dict) -> None:
    assert derive_supports(patches) == {**expected, "handles": []}
