"""The import arrows point one way (README "Architecture").

Every module of the product packages is parsed with ``ast`` (nothing is
imported, so an import hidden in a function counts as much as one at the
top: it runs the first time that function does), and two rules hold:

- layers: a package imports only packages of a lower tier in ``TIERS``; an
  import of a package beside or above it is reported with the module and line;
- cycles: no two modules import each other, directly or around a loop; a
  cycle is reported as the loop of module names.

Both checks run on a synthetic graph first, with an upward edge and a
cycle planted, so each can be seen to fail. A third test imports
``preload.identity``, ``preload.protocol`` and ``preload.sockets`` in a
subprocess where torch and vLLM cannot be imported at all.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

# Bottom first: a package imports only packages of an earlier tier, never
# one of its own tier or above. fixtures (test checkpoints) and preload (the
# product) share a tier: each stands on pgbase, neither needs the other.
# canaries sits under harness because the gate records the golden at
# promotion (harness.gate -> canaries.golden); canaries never needs the gate.
TIERS: tuple[tuple[str, ...], ...] = (
    ("pgbase",), ("fixtures", "preload"), ("canaries",), ("harness",), ("preload_gate",),
)
PACKAGES = tuple(p for tier in TIERS for p in tier)
# Known cycles still to break, listed exactly: the test fails when one is
# gone (delete its entry) as much as when a new one appears. None today.
PENDING_CYCLES: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``line`` of ``source``'s file."""

    source: str
    target: str
    line: int


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under each package directory."""
    out: dict[str, Path] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            out[module_name(path, root)] = path
    return out


def _resolve(name: str, known: Mapping[str, Path]) -> str | None:
    """The longest known module that ``name`` is or lies in (``a.b.C`` -> ``a.b``)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, source: str, known: Mapping[str, Path]) -> list[Edge]:
    """Every import in ``source`` (top level, in functions, under TYPE_CHECKING)
    that names a module in ``known``. ``from a import b`` is an edge to ``a.b``
    when that is a module, else to ``a``."""
    tree = ast.parse(source)
    is_pkg = known[module].name == "__init__.py" if module in known else False
    package = module if is_pkg else module.rpartition(".")[0]
    edges: list[Edge] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, known)
                if target:
                    edges.append(Edge(module, target, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                target = submodule if submodule in known else _resolve(base, known)
                if target:
                    edges.append(Edge(module, target, node.lineno))
    return [e for e in edges if e.target != module]


def import_graph(root: Path, packages: Iterable[str]) -> list[Edge]:
    known = product_modules(root, packages)
    edges: list[Edge] = []
    for name, path in known.items():
        edges += imports_of(name, path.read_text(), known)
    return edges


def upward_imports(edges: Iterable[Edge], tiers: tuple[tuple[str, ...], ...]) -> list[str]:
    """One line per import of a package of the importer's own tier or above."""
    rank = {pkg: i for i, tier in enumerate(tiers) for pkg in tier}
    found = []
    for e in edges:
        src, dst = e.source.partition(".")[0], e.target.partition(".")[0]
        if src != dst and rank[dst] >= rank[src]:
            where = "beside" if rank[dst] == rank[src] else "below"
            found.append(f"{e.source}:{e.line} imports {e.target} ({src} is {where} {dst})")
    return sorted(set(found))


def module_cycles(edges: Iterable[Edge]) -> list[list[str]]:
    """Each strongly connected group of modules, as one loop through it
    (first module repeated at the end), by Tarjan's algorithm."""
    succ: dict[str, set[str]] = {}
    for e in edges:
        succ.setdefault(e.source, set()).add(e.target)
        succ.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        # Recursive: product import chains are far shallower than Python's limit.
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return [_loop(sorted(g)[0], g, succ) for g in groups]


def _loop(start: str, group: set[str], succ: Mapping[str, set[str]]) -> list[str]:
    """A shortest loop from ``start`` back to itself inside ``group`` (breadth first)."""
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(succ[v] & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in a strongly connected group but on no loop")


# ------------------------------------------------------------------ controls


def _synthetic(tmp_path: Path, files: Mapping[str, str]) -> list[Edge]:
    for rel, src in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(src))
    return import_graph(tmp_path, ("low", "high"))


def _upward(tiers: tuple[tuple[str, ...], ...]) -> Callable[[list[Edge]], list[str]]:
    return lambda edges: upward_imports(edges, tiers)


_UPWARD_IN_A_FUNCTION = {
    "low/__init__.py": "",
    "low/a.py": "def f():\n    from high.b import thing\n",
    "high/__init__.py": "",
    "high/b.py": "from low import a\nthing = 1\n",
}

# Each planted fault: the files, the checker, what it must report, and the
# edit that makes its neighbour clean (the same checker then reports nothing).
PLANTED = [
    pytest.param(_UPWARD_IN_A_FUNCTION, _upward((("low",), ("high",))),
                 ["low.a:2 imports high.b (low is below high)"],
                 {"low/a.py": "def f():\n    return 1\n"}, id="upward-import-inside-a-function"),
    # Packages of one tier may not import each other either.
    pytest.param(_UPWARD_IN_A_FUNCTION, _upward((("low", "high"),)),
                 ["high.b:1 imports low.a (high is beside low)", "low.a:2 imports high.b (low is beside high)"],
                 {"low/a.py": "def f():\n    return 1\n", "high/b.py": "thing = 1\n"}, id="import-beside"),
    pytest.param({
        "low/__init__.py": "",
        "low/a.py": "from .b import x\n",
        "low/b.py": "from . import c\nx = 1\n",
        "low/c.py": "def f():\n    import low.a\n",
        "high/__init__.py": "from low.a import x\n",
    }, module_cycles, [["low.a", "low.b", "low.c", "low.a"]], {"low/c.py": "y = 2\n"},
        id="cycle-through-relative-imports"),
]


@pytest.mark.parametrize(("files", "check", "found", "fix"), PLANTED)
def test_the_checker_reports_a_planted_fault_and_not_its_fixed_neighbour(
    tmp_path: Path, files: Mapping[str, str], check: Callable[[list[Edge]], list],
    found: list, fix: Mapping[str, str],
) -> None:
    assert check(_synthetic(tmp_path, files)) == found
    assert check(_synthetic(tmp_path, fix)) == []


# ------------------------------------------------------------------ the tree


def test_every_product_package_has_a_tier() -> None:
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert on_disk == set(PACKAGES)


def test_no_package_imports_one_beside_or_above_it() -> None:
    assert upward_imports(import_graph(ROOT, PACKAGES), TIERS) == []


def test_no_module_import_cycle() -> None:
    cycles = [tuple(c) for c in module_cycles(import_graph(ROOT, PACKAGES))]
    assert sorted(cycles) == sorted(PENDING_CYCLES), "\n".join(" -> ".join(c) for c in cycles)


def test_identity_protocol_and_sockets_import_without_torch_or_vllm() -> None:
    script = textwrap.dedent("""
        import importlib.abc
        import sys

        BLOCKED = ("torch", "vllm")

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in BLOCKED:
                    raise ImportError(f"{name} is blocked by the test")
                return None

        sys.meta_path.insert(0, Block())
        for name in BLOCKED:
            try:
                __import__(name)
            except ImportError:
                pass
            else:
                raise SystemExit(f"control: {name} imported through the block")
        try:  # control: a module of ours that does need torch is refused
            import preload.transports.base  # noqa: F401
        except ImportError:
            pass
        else:
            raise SystemExit("control: preload.transports.base imported without torch")
        import preload.identity, preload.protocol, preload.sockets  # noqa: E401
        loaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
        assert not loaded, loaded
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
