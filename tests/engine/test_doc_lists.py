"""The lists of models in README.md and docs/*.md are the specs' (tools/doc_lists.py): the committed docs match what
the specs give, every doc that lists models does so in a marked region, and the tool rewrites a stale region, names
it under --check and refuses a malformed one in one line without writing anything."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from patchgen.config import load_config
from tests.engine.helpers import REPO
from tools.doc_lists import REWRITE, regions, stale_lists
from tools.doc_lists import main as doc_lists

# The docs that list models, and the selectors each must carry: a list written by hand there is the drift this stops.
LISTING_DOCS = {
    "README.md": {"causal_lm", "vlm", "omni", "dit"},
    "docs/training.md": {"causal_lm", "vlm", "omni", "dit"},
    "docs/dit.md": {"dit"},
    "docs/flowgrpo.md": {"dit:flow"},
    "docs/parallelism.md": {"vlm", "vlm+omni", "dit"},
}


def test_committed_docs_list_the_models_the_specs_declare() -> None:
    stale, total = stale_lists(load_config(REPO))
    assert not stale, "\n".join(stale) + f"\nrun `{REWRITE}` to rewrite them"
    assert total >= sum(len(selectors) for selectors in LISTING_DOCS.values())


@pytest.mark.parametrize("doc", sorted(LISTING_DOCS))
def test_each_listing_doc_marks_its_lists(doc: str) -> None:
    found = {region.selector for region in regions(doc, (REPO / doc).read_text(encoding="utf-8"))}
    missing = LISTING_DOCS[doc] - found
    assert not missing, f"{doc}: no <!-- models:SELECTOR:begin --> region for {sorted(missing)}"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The real specs and templates (the models), the real condition models (`:flow`), no generated files."""
    root = tmp_path / "proj"
    for name in ("specs", "templates", "runtime/diffusion/conditions"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "pyproject.toml", root / "pyproject.toml")
    (root / "generated").mkdir()
    (root / "docs").mkdir()
    return root


def region(selector: str, body: str = "`wan`") -> str:
    return f"<!-- models:{selector}:begin -->{body}<!-- models:{selector}:end -->"


def test_check_names_a_stale_region_and_a_rewrite_fills_it(project: Path, capsys) -> None:
    readme = f"# x\nRL trains {region('dit:flow')}.\n"
    (project / "README.md").write_text(readme)
    other = f"VLMs and omni: {region('vlm+omni', '')}; MoE: {region('causal_lm:moe')}\n"
    (project / "docs" / "a.md").write_text(other)

    assert doc_lists(["--check", "--root", str(project)]) == 1
    err = capsys.readouterr().err
    assert "README.md:2: the models:dit:flow list differs" in err
    assert "docs/a.md:1: the models:vlm+omni list differs" in err
    assert f"run `{REWRITE}`" in err
    assert (project / "README.md").read_text() == readme  # --check writes nothing

    assert doc_lists(["--root", str(project)]) == 0
    text = (project / "README.md").read_text()
    assert "`auraflow`, " in text and "`ltx_video`, " in text and "`lumina2`, " in text and "`wan`<!--" in text
    assert "`cogvideox`" not in text  # v-prediction (runtime/diffusion/conditions/cogvideox.py): RL refuses it
    assert "`qwen3`" not in text
    other = (project / "docs" / "a.md").read_text()
    assert "`qwen2_vl`, `qwen3_omni_moe_thinker`, `qwen3_vl`" in other
    assert "`gpt_oss`" in other and "`llama`" not in other  # :moe keeps the MoE language models only
    capsys.readouterr()
    assert doc_lists(["--check", "--root", str(project)]) == 0


@pytest.mark.parametrize(
    "text, message",
    [
        ("a <!-- models:dit:begin -->`wan`\n", "README.md:1: <!-- models:dit:begin --> is never closed"),
        ("a\n`wan`<!-- models:dit:end -->\n", "README.md:2: <!-- models:dit:end --> closes no region"),
        (f"{region('dit')}\n<!-- models:dit:begin -->x<!-- models:vlm:end -->", "README.md:2: <!-- models:dit:begin"),
        (region("dits"), "README.md:1: models:dits: unknown family 'dits'"),
        (region("dit:fast"), "README.md:1: models:dit:fast: unknown filter 'fast'"),
    ],
)
def test_a_malformed_region_is_one_line_exit_2_and_nothing_is_written(
    project: Path, capsys, text: str, message: str
) -> None:
    stale = f"{region('dit')}\n"
    (project / "docs" / "a.md").write_text(stale)  # sorted after README.md: would be rewritten if writes were eager
    (project / "README.md").write_text(text)
    assert doc_lists(["--root", str(project)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert (project / "docs" / "a.md").read_text() == stale
