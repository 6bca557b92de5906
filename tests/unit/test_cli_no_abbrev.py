"""No parser accepts an abbreviated option (issue 39).

argparse's prefix matching turned ``stop --a`` into ``stop --all`` (every
daemon stopped, every stored arena dropped). Every verb and sub-verb parser
is walked: it refuses abbreviations, and each of its long options cut short
by one character is refused in one line, exit 2, with nothing run. The
control puts the old rule (``allow_abbrev=True``) back and shows ``stop --a``
running ``stop --all``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

import preload_gate.cli as cli
from preload.daemon import keeper

pytestmark = pytest.mark.unit


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    out = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _parsers(sub, (*path, name))
    return out


PARSERS = _parsers(cli.build_parser())


def test_every_verb_is_walked() -> None:
    verbs = {p[0] for p, _ in PARSERS if len(p) == 1}
    assert verbs == set(cli.VERBS)
    assert ("canary", "record") in {p for p, _ in PARSERS} and ("fixtures", "tiny") in {p for p, _ in PARSERS}


@pytest.mark.parametrize("path,parser", PARSERS, ids=[" ".join(p) or "preload-gate" for p, _ in PARSERS])
def test_no_parser_allows_abbreviations(path: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
    assert parser.allow_abbrev is False, " ".join(path)


def _cut_options(parser: argparse.ArgumentParser) -> list[str]:
    """Each long option one character short, where that is no option of its own."""
    longs = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    return sorted({o[:-1] for o in longs if len(o) > 3 and o[:-1] not in longs})


CASES = [(path, cut) for path, p in PARSERS if path for cut in _cut_options(p)]


@pytest.mark.parametrize("path,cut", CASES, ids=[f"{' '.join(p)} {c}" for p, c in CASES])
def test_a_cut_option_is_refused_in_one_line(path: tuple[str, ...], cut: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([*path, cut])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.count("\n") == 1 and "error:" in err, err


def test_keeper_parser_refuses_abbreviations(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        keeper.main(["--socket-root", "/nonexistent", "--idle", "1"])
    assert exc.value.code == 2 and "unrecognized arguments: --idle" in capsys.readouterr().err


@pytest.mark.parametrize("abbrev", [False, True], ids=["fixed", "control_old_rule"])
def test_stop_a_does_not_stop_everything(abbrev: bool, tmp_path: Path, monkeypatch, capsys) -> None:
    from preload.daemon import stop

    ran: list[Any] = []
    monkeypatch.setattr(stop, "stop", lambda target, root, **kw: ran.append(target) or stop.StopReport(
        target=str(target), socket_root=str(root), stopped=[], dropped=[], store=None))
    if abbrev:  # the old rule: argparse's default prefix matching
        real = cli._OneLineParser.__init__

        def old(self: Any, *a: Any, **kw: Any) -> None:
            real(self, *a, **kw)
            self.allow_abbrev = True

        monkeypatch.setattr(cli._OneLineParser, "__init__", old)
    root = tmp_path / "root"
    root.mkdir()
    for typo in ("--a", "--al"):
        ran.clear()
        try:
            rc = cli.main(["stop", typo, "--socket-root", str(root)])
        except SystemExit as exc:
            rc = exc.code
        if abbrev:
            assert rc == 0 and ran and ran[0].all  # the bug: a typo stops every daemon
        else:
            assert rc == 2 and not ran
            assert f"unrecognized arguments: {typo}" in capsys.readouterr().err
