"""What an engine's first attach imports: the client, not promotion.

``preload.client`` is imported inside vLLM's weight-load phase. Through the
package ``__init__`` it once imported promotion, every anchor scheme, the
manifest and its stat backends (39 ms against 22 ms now, ``python -X
importtime``). The row checks, in a fresh interpreter, that those modules
stay out; the control imports ``preload.promote`` and sees them come in, so
the check can tell.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

HEAVY = ("preload.promote", "preload.identity.anchors", "preload.identity.manifest",
         "preload.identity.filestat", "preload.identity.digest")


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out)) & set(HEAVY)


def test_the_engine_client_imports_no_promotion_manifest_or_anchor_module() -> None:
    assert _loaded_after("import preload.client") == set()


def test_control_importing_promotion_and_the_anchors_brings_them_in() -> None:
    assert _loaded_after("import preload.promote, preload.identity.anchors") == set(HEAVY)


def test_the_packages_bind_only_submodules() -> None:
    """No function re-exported under a submodule's name: ``preload.promote``
    is always the module (a lazy re-export returned the module or the
    function depending on what was imported first)."""
    import types

    import preload
    import preload.identity
    import preload.promote  # noqa: F401 (binds the attribute being checked)

    for pkg in (preload, preload.identity):
        names = {n: v for n, v in vars(pkg).items() if not n.startswith("_")}
        assert names and all(isinstance(v, types.ModuleType) for v in names.values()), names
