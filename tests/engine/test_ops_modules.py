"""Each operation is one module that owns its spec keys, resolution and application (issue 11 F)."""

from __future__ import annotations

import subprocess
import sys

from patchgen.ops import OPS
from tests.engine.helpers import REPO


def test_every_template_op_is_one_module_with_its_own_keys() -> None:
    assert sorted(OPS) == [
        "add_definition",
        "add_method",
        "add_parameter",
        "insert",
        "rename",
        "replace",
        "replace_definition",
        "replace_method",
        "wrap",
    ]
    assert OPS["insert"].check_keys(("before",)) is None and OPS["insert"].check_keys(()) is not None
    assert OPS["replace"].takes_through and not OPS["wrap"].takes_through
    assert OPS["wrap"].builtins == ("scope", "expr")
    modules = {type(op).__module__ for op in OPS.values()}
    assert len(modules) == len(OPS) - 1  # replace_method and replace_definition share one module


def test_loading_a_spec_never_imports_libcst() -> None:
    """The fast drift check loads every spec (which asks each op for its keys) without libcst."""
    code = (
        "import sys; import patchgen.project; from patchgen.config import load_config; "
        "from patchgen.spec_set import load_specs; "
        "load_specs(load_config(), None); assert 'libcst' not in sys.modules, 'libcst imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
