"""The verb table (``preload_gate.cli.VERBS``) and the bench row table
(``harness.bench.ROW_MODULES``) are authoritative, and one import rule
(``preload.extras``) serves both:

- the table and what each module registers agree, both ways (a module that
  adds a verb the table lacks, or a table verb nobody adds, is an error);
- a verb or row module that fails to import is one line naming the verb, the
  module and the import error, exit 2; never a verb that is silently missing;
- only a module marked with an optional extra is skipped when a third-party
  module is missing, and --help (or the bench table) says which extra to
  install while every other verb keeps working;
- no module in either table needs an extra to be imported (so none is
  marked), shown with the extras' packages blocked.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

import harness.bench as bench
import preload_gate.cli as cli
from preload.extras import EXTRAS, ExtraMissingError, ModuleLoadError, import_for

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

# What the optional extras add over the base install (pyproject); blocked in
# a subprocess to show that --help and every verb load without them.
EXTRA_PACKAGES = ("vllm", "triton", "transformers", "gguf", "accelerate")


@pytest.fixture
def fake_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write importable modules (name -> source) for one test; forgotten after it."""

    def write(**sources: str) -> None:
        for name, src in sources.items():
            (tmp_path / f"{name}.py").write_text(textwrap.dedent(src))
            monkeypatch.delitem(sys.modules, name, raising=False)

    monkeypatch.syspath_prepend(str(tmp_path))
    yield write
    for p in tmp_path.glob("*.py"):
        sys.modules.pop(p.stem, None)


def _registers(*verbs: str) -> str:
    lines = ["def register(sub):"]
    lines += [f"    sub.add_parser({v!r}, help='fake {v}').set_defaults(func=lambda a: 0)" for v in verbs]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------- the table


def test_table_and_registered_verbs_agree() -> None:
    """Each module registers exactly the verbs the table gives it."""
    registered: dict[str, str] = {}
    for module in dict.fromkeys(v.module for v in cli.VERBS.values()):
        sub = argparse.ArgumentParser().add_subparsers()
        for verb in cli.register_module(sub, module):
            assert verb not in registered, f"{verb} is registered by {registered[verb]} and {module}"
            registered[verb] = module
    assert registered == {name: v.module for name, v in cli.VERBS.items()}


def test_a_verb_missing_from_the_table_is_an_error(monkeypatch, capsys) -> None:
    table = dict(cli.VERBS)
    del table["demo"]
    monkeypatch.setattr(cli, "VERBS", table)
    with pytest.raises(cli.VerbTableError, match=r"harness\.cli adds verbs .*'demo'"):
        cli.build_parser()
    assert cli.main(["promote", "--help"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "demo" in err and "VERBS" in err


def test_a_table_verb_nobody_registers_is_an_error(monkeypatch) -> None:
    monkeypatch.setattr(cli, "VERBS", {**cli.VERBS, "ghost": cli.Verb("harness.cli")})
    with pytest.raises(cli.VerbTableError, match="ghost"):
        cli.build_parser()


def test_one_module_one_extra(monkeypatch) -> None:
    monkeypatch.setattr(cli, "VERBS", {**cli.VERBS, "gate": cli.Verb("harness.cli", extra="gpu")})
    with pytest.raises(cli.VerbTableError, match="different extras"):
        cli.build_parser()


def test_extras_are_pyprojects() -> None:
    """EXTRAS is what the installed distribution declares (pyproject's optional-dependencies)."""
    assert set(EXTRAS) == set(metadata.metadata("preload-gate").get_all("Provides-Extra") or [])
    with pytest.raises(ValueError, match="unknown extra 'tpu'"):
        import_for("preload.protocol", "tpu")


# --------------------------------------------------------- failed imports


def test_a_verb_whose_module_fails_to_import_is_one_line_exit_2(fake_modules, monkeypatch, capsys) -> None:
    fake_modules(pg_fake_broken="import pg_no_such_dist\n" + _registers("broken"))
    monkeypatch.setattr(cli, "VERBS", {**cli.VERBS, "broken": cli.Verb("pg_fake_broken")})
    # Any verb, --help included: an install that lost a verb is not half-working.
    assert cli.main(["--help"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "verb broken" in err and "pg_fake_broken" in err and "No module named 'pg_no_such_dist'" in err


def test_a_verb_module_raising_at_import_is_an_error(fake_modules, monkeypatch) -> None:
    fake_modules(pg_fake_raises="raise RuntimeError('bad at import')\n")
    monkeypatch.setattr(cli, "VERBS", {**cli.VERBS, "r": cli.Verb("pg_fake_raises", extra="gpu")})
    with pytest.raises(cli.VerbTableError, match="RuntimeError: bad at import"):
        cli.build_parser()


def test_marked_verb_is_unavailable_without_its_extra_and_the_rest_work(fake_modules, monkeypatch, capsys) -> None:
    fake_modules(pg_fake_gpu="import pg_no_such_dist\n" + _registers("warp"))
    monkeypatch.setattr(cli, "VERBS", {**cli.VERBS, "warp": cli.Verb("pg_fake_gpu", extra="gpu")})
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps help at the terminal width
    with pytest.raises(SystemExit) as exit_help:
        cli.main(["--help"])
    assert exit_help.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert ("warp (unavailable: needs the gpu extra (No module named 'pg_no_such_dist'): "
            "pip install 'preload-gate[gpu]')") in help_text
    assert all(v in help_text for v in cli.VERBS)
    # Run, with arguments: one line saying the same, exit 2.
    assert cli.main(["warp", "--x", "y"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "preload-gate[gpu]" in err and "pg_no_such_dist" in err
    # Every other verb still works.
    assert cli.main(["bench", "--list"]) == 0
    assert "restart_identity" in capsys.readouterr().out


def test_marked_verb_missing_a_module_of_our_own_is_still_an_error(fake_modules, monkeypatch) -> None:
    """Control for the skip above: the extra covers third-party packages only."""
    fake_modules(pg_fake_ours="import preload.no_such_module\n" + _registers("ours"))
    monkeypatch.setattr(cli, "VERBS", {**cli.VERBS, "ours": cli.Verb("pg_fake_ours", extra="gpu")})
    with pytest.raises(cli.VerbTableError, match="verb ours cannot load: module pg_fake_ours"):
        cli.build_parser()


def test_import_for_rule() -> None:
    with pytest.raises(ExtraMissingError, match=r"preload-gate\[hf\]"):
        import_for("pg_no_such_dist", "hf")
    with pytest.raises(ModuleLoadError, match="pg_no_such_dist"):
        import_for("pg_no_such_dist")


def test_no_table_module_needs_an_extra_to_import() -> None:
    """With the extras' packages blocked, every verb and row module imports
    and --help lists every verb, none unavailable (so none needs marking)."""
    script = textwrap.dedent(f"""
        import sys
        for name in {EXTRA_PACKAGES!r}:
            sys.modules[name] = None  # import raises ModuleNotFoundError
        import importlib
        try:
            importlib.import_module("vllm")
        except ModuleNotFoundError:
            pass
        else:
            raise SystemExit("control: the block did not hold")
        import harness.bench as bench
        from preload_gate.cli import main
        bench.load_rows()
        assert not bench.UNLOADED, bench.UNLOADED
        print(sorted({{r.run.__module__ for r in bench.ROWS.values()}}))
        main(["--help"])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "unavailable" not in proc.stdout
    for verb in cli.VERBS:
        assert f"    {verb} " in proc.stdout or f"    {verb}\n" in proc.stdout, verb
    assert sorted(bench.ROW_MODULES) == eval(proc.stdout.splitlines()[0])  # noqa: S307 (our own print)


# ------------------------------------------------------------ bench rows


def test_row_table_and_registered_rows_agree() -> None:
    """Each module in ROW_MODULES registers rows; every row comes from one of them."""
    rows = bench.load_rows()
    assert {r.run.__module__ for r in rows.values()} == set(bench.ROW_MODULES)


def test_a_row_module_that_fails_to_import_is_an_error(fake_modules, monkeypatch) -> None:
    fake_modules(pg_fake_rows="import pg_no_such_dist\n")
    monkeypatch.setattr(bench, "ROW_MODULES", {**bench.ROW_MODULES, "pg_fake_rows": ""})
    with pytest.raises(bench.BenchError, match="module pg_fake_rows failed to import.*pg_no_such_dist"):
        bench.run_rows(bench.BenchOptions(), only=["restart_identity"])


def test_a_marked_row_module_without_its_extra_reports_not_run(fake_modules, monkeypatch) -> None:
    fake_modules(pg_fake_gpu_rows="import pg_no_such_dist\n")
    monkeypatch.setattr(bench, "ROW_MODULES", {**bench.ROW_MODULES, "pg_fake_gpu_rows": "gpu"})
    monkeypatch.setattr(bench, "UNLOADED", {})
    bench.load_rows()
    monkeypatch.setattr(bench, "ROWS", {})  # run no real row; only the unloaded module reports
    results = bench.run_rows(bench.BenchOptions())
    assert [r.row for r in results] == ["pg_fake_gpu_rows"]
    assert "preload-gate[gpu]" in (results[0].not_run or "")
    with pytest.raises(bench.BenchError, match="rows of pg_fake_gpu_rows not loaded"):
        bench.run_rows(bench.BenchOptions(), only=["some_gpu_row"])


def test_readme_architecture_names_each_verbs_module() -> None:
    """README "Architecture" says where each verb lives; it is VERBS's word."""
    import re

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    said: dict[str, str] = {}
    for verbs, module in re.findall(r"^\| ((?:`[a-z]+`(?:, )?)+) \| `([a-z_.]+)`", section, re.M):
        for verb in re.findall(r"`([a-z]+)`", verbs):
            said[verb] = module
    assert said == {name: verb.module for name, verb in cli.VERBS.items()}
