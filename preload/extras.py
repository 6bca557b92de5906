"""Import a module that may need one of the distribution's optional extras.

The CLI's verb table (``preload_gate.cli.VERBS``) and the bench's row table
(``harness.bench.ROW_MODULES``) name, per module, the optional extra it
cannot be imported without ("" when none). One rule serves both, so a broken
install is never a verb or a row that silently is not there:

- a module marked with no extra that fails to import, for any reason, is an
  error (``ModuleLoadError``, naming the module and the import error);
- a module marked with an extra is skipped (``ExtraMissingError``, naming the
  extra to install) only when its import fails because a module from outside
  this project is missing (``ModuleNotFoundError``, e.g. ``vllm``). Any other
  failure of a marked module (a missing module of our own, a SyntaxError, an
  error raised at import) is still a ``ModuleLoadError``.

>>> import_for("preload.protocol").__name__
'preload.protocol'
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from pgbase.errors import PreloadGateError
from pgbase.oscause import file_limit, file_limit_now

# pyproject's [project.optional-dependencies] (tests/unit/test_cli_verbs.py
# holds them equal to the installed distribution's Provides-Extra).
EXTRAS = ("cpu", "gpu", "hf", "dev", "ray")

# Top-level packages of this distribution: one of these missing is a broken
# install or a bug, never a missing extra.
OWN_PACKAGES = ("preload", "harness", "fixtures", "canaries", "preload_gate")


class ModuleLoadError(PreloadGateError):
    """A module the project ships failed to import (``module`` names it)."""

    def __init__(self, module: str, cause: BaseException) -> None:
        self.module = module
        super().__init__(
            f"module {module} failed to import: {type(cause).__name__}: {cause} "
            "(reinstall preload-gate; if that does not help, this is a bug)"
        )


class ExtraMissingError(PreloadGateError):
    """A module marked as needing an optional extra cannot import without it."""

    def __init__(self, module: str, extra: str, cause: ModuleNotFoundError) -> None:
        self.module, self.extra = module, extra
        super().__init__(f"needs the {extra} extra ({cause}): pip install 'preload-gate[{extra}]'")


def import_for(module: str, extra: str = "") -> ModuleType:
    """Import ``module``; ``extra`` is the optional extra it needs ("" for none).

    Raises ``ExtraMissingError`` when a marked module lacks a third-party
    module (skip it, saying why), ``ModuleLoadError`` for every other import
    failure, ``ValueError`` for an ``extra`` pyproject does not declare, and
    ``OSError`` (EMFILE/ENFILE) when the import ran into the open-file limit
    (no fault of the module's: :func:`pgbase.oscause.file_limit` names it).
    """
    if extra and extra not in EXTRAS:
        raise ValueError(f"{module}: unknown extra {extra!r}; pyproject declares {', '.join(EXTRAS)}")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        # At the open-file limit the import system cannot list a directory
        # and reports the module missing: neither an extra nor a bad install.
        limit = file_limit_now()
        if limit is not None and limit.errno is not None:
            raise OSError(limit.errno, f"importing {module}: {os.strerror(limit.errno)}") from exc
        missing = (exc.name or "").partition(".")[0]
        if extra and missing and missing not in OWN_PACKAGES:
            raise ExtraMissingError(module, extra, exc) from exc
        raise ModuleLoadError(module, exc) from exc
    except Exception as exc:
        if file_limit(exc) is not None:
            raise  # the limit, not the module: said as such by the caller (the CLI's one line)
        raise ModuleLoadError(module, exc) from exc
