"""Nothing a held verb starts outlives its ``kill -9`` (``pgbase.survivor``).

Each test starts a process with ``$PRELOAD_GATE_OWNERS`` set to a tag of
its own (an outer holder, as far as the code under test knows): everything
that process starts carries the tag, so :func:`pgbase.survivor.owned`
finds every descendant, reparented or in a session of its own, and the
test can see what is left after the SIGKILL and stop it.

- Every spawner of the tree (the kill -9 table, one starter running them
  all: prepare children, vLLM's preload of the ipc_cache target, the golden
  recorder, supervised replicas, daemons without ``--exit-with-parent``,
  ranks, engine workers, the bench's sha256sum anchor), each child starting
  a grandchild in a new session: under :func:`hold` nothing is left;
  control, the same starter without it: each of them still runs (today's
  code before the survivor).
- A FUSE mount of a held process is unmounted by the survivor even when its
  server is stopped first (a SIGTERMed server leaves a dead mount); control:
  the same kill without a holder leaves the dead mount, and a sweep of its
  tag then removes it.
- ``preload-gate bench`` itself, SIGKILLed while its restart_identity row
  has the FUSE mirror mounted: no process, no mount left.
- Static: every call in the tree that starts a process with an ``env=`` of
  its own builds it from ``os.environ`` (or is in the kill -9 table): an
  environment made from scratch would drop the token and escape.

Every wait is a generous bound on a poll, not a timing claim.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from daemon_support import REPO, repo_pythonpath, starter_line, wait_for
from reliability_support import skip_privileged

from pgbase import survivor

pytestmark = [pytest.mark.unit, pytest.mark.timeout(240)]

BOUND_S = 60.0

# A child that would run for an hour, with a grandchild in a session of its
# own (as vLLM's engine cores and a daemon's ranks are): writes "pid gpid"
# to $PG_STANDIN_DIR/NAME, NAME its first argument.
STANDIN = textwrap.dedent("""
    import os, subprocess, sys, time
    a = sys.argv[1]  # a spawner's name, or (the engine worker's) its spec path: the directory names it
    name = os.path.basename(os.path.dirname(a)) if os.sep in a else a
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    path = os.path.join(os.environ["PG_STANDIN_DIR"], name)
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {g.pid}")
    os.rename(path + ".tmp", path)
    time.sleep(3600)
""")

# The starter: holds (argv[1] == "1") and runs every spawner with the
# stand-in in place of what it starts; prints "ready" once all have started.
STARTER = textwrap.dedent("""
    import os, sys, threading, time, types
    from pathlib import Path
    held, work = sys.argv[1] == "1", Path(sys.argv[2])
    from pgbase import survivor
    if held:
        survivor.hold("test")
    standin = [sys.executable, "-m", "pgstandin"]

    def bg(fn, *a):
        threading.Thread(target=fn, args=a, daemon=True).start()

    from harness.targets import _procs
    bg(_procs.run_all, [[*standin, "run_all"]], [work / "run_all.log"], 3600.0)

    from harness.targets.ipc_cache import IpcCacheTarget
    t = IpcCacheTarget()
    t.preload_command = (*standin, "ipc_cache")
    from harness.targets.base import PrepareContext
    ctx = PrepareContext(workdir=work / "ipc", socket_root=str(work), engine_timeout_s=3600.0,
                         digest_of=lambda _p: "0" * 64, promote=lambda _p: "0" * 64)
    bg(t.prepare, work, types.SimpleNamespace(dtype="bfloat16", tensor_parallel_size=1), ctx)

    from canaries import golden
    golden._WORKER_ARGS = ("-m", "pgstandin", "golden")
    bg(golden._run_worker, {}, 3600.0)

    from harness.rollout.replicas import Target
    from harness.rollout.state import ReplicaRecord
    from harness.rollout.supervised import SupervisedDriver
    from pgbase.ports import free_port
    d = SupervisedDriver([*standin, "supervised"], [], work, "rid")
    d.restart(ReplicaRecord(0, f"http://127.0.0.1:{free_port()}", str(work / "ev.jsonl")),
              Target(str(work), "0" * 64, "A", str(work)), lambda: None)

    from preload.daemon import ready
    ready.PRELOAD_COMMAND = ("-m", "pgstandin", "start_preload")
    ready.start_preload([], new_session=True)  # as the rollout starts its daemons
    ready.RANK_COMMAND = ("-m", "pgstandin", "start_rank")
    ready.start_rank({})

    from harness.engine import EngineSpec, run_engine
    bg(run_engine, EngineSpec(checkpoint=str(work)), work / "engine", 3600.0, "pgstandin")

    print("started", flush=True)
    time.sleep(3600)
""")

# What the starter runs, by the name each stand-in writes. (The real engine
# worker watches its starter by itself; the stand-in in its place does not.)
SPAWNERS = ("run_all", "ipc_cache", "golden", "supervised", "start_preload", "start_rank", "engine")


def _env(tag: str, standin_dir: Path, tmp: Path) -> dict[str, str]:
    return {**os.environ, survivor.OWNERS_ENV: tag, "PG_STANDIN_DIR": str(standin_dir), "TMPDIR": str(tmp),
            "PYTHONPATH": os.pathsep.join([str(standin_dir.parent / "mods"), repo_pythonpath()])}


def _standins(tmp_path: Path) -> Path:
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "pgstandin.py").write_text(STANDIN)
    d = tmp_path / "standins"
    d.mkdir()
    return d


def _readline(proc: subprocess.Popen, bound: float = BOUND_S) -> str:
    return starter_line(proc, bound)


@pytest.fixture
def tag(request):
    t = f"test{os.getpid()}{abs(hash(request.node.nodeid)) % 10**8}"
    yield t
    survivor.sweep(t, term_s=5.0, kill_s=5.0)  # whatever a failing test left


def _run_spawners(tmp_path: Path, tag: str, held: bool) -> dict[str, tuple[int, int]]:
    """Start the starter, wait until every stand-in runs, SIGKILL the starter;
    returns each spawner's (child, grandchild) pids."""
    standins = _standins(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    starter = subprocess.Popen([sys.executable, "-c", STARTER, "1" if held else "0", str(work)],
                               stdout=subprocess.PIPE, text=True, env=_env(tag, standins, tmp_path), cwd=REPO)
    try:
        assert _readline(starter) == "started"
        assert wait_for(lambda: len(list(standins.iterdir())) >= len(SPAWNERS), BOUND_S), sorted(
            p.name for p in standins.iterdir())
    finally:
        starter.kill()
        starter.wait()
    pids = {p.name: tuple(int(x) for x in p.read_text().split()) for p in standins.iterdir()}
    assert set(pids) == set(SPAWNERS)
    return pids  # type: ignore[return-value]


def test_nothing_any_spawner_starts_outlives_a_held_starters_kill_9(tmp_path, tag) -> None:
    pids = _run_spawners(tmp_path, tag, held=True)
    assert wait_for(lambda: not survivor.owned(tag), BOUND_S), {
        name: pair for name, pair in pids.items() if any(p in survivor.owned(tag) for p in pair)}


def test_control_without_a_holder_every_spawner_leaves_its_processes(tmp_path, tag) -> None:
    pids = _run_spawners(tmp_path, tag, held=False)
    wait_for(lambda: False, 3.0)  # as long as a survivor would have needed, and more
    left = set(survivor.owned(tag))
    assert {name for name, pair in pids.items() if set(pair) <= left} == set(SPAWNERS)


def _fuse_mountable() -> None:
    if os.geteuid() != 0:
        skip_privileged("mounting FUSE needs root (no fusermount here)")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse device node on this machine")


FUSE_STARTER = textwrap.dedent("""
    import os, sys, time
    from harness.bench.fuse_fs import FuseFS
    from pgbase import survivor
    if sys.argv[1] == "1":
        survivor.hold("test")
    fs = FuseFS(sys.argv[2])
    mnt = fs.__enter__()
    print(mnt, fs._server.pid, flush=True)
    time.sleep(3600)
""")


def _mounted(mp: str) -> bool:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return any(line.split()[4] == mp for line in f)


@pytest.mark.parametrize("held", [True, False], ids=["held", "control-no-holder"])
def test_a_fuse_mount_is_unmounted_by_the_survivor_even_with_its_server_dead(tmp_path, tag, held) -> None:
    _fuse_mountable()
    real = tmp_path / "real"
    real.mkdir()
    (real / "a").write_bytes(b"x")
    starter = subprocess.Popen([sys.executable, "-c", FUSE_STARTER, "1" if held else "0", str(real)],
                               stdout=subprocess.PIPE, text=True, env=_env(tag, tmp_path, tmp_path), cwd=REPO)
    try:
        mp, server = _readline(starter).split()
        assert _mounted(mp) and mp in survivor.mounts_of(tag)
        # Both gone at once: no teardown of the starter's, no unmount of the server's.
        os.kill(int(server), signal.SIGKILL)
    finally:
        starter.kill()
        starter.wait()
    if held:
        assert wait_for(lambda: not _mounted(mp) and not os.path.exists(mp), BOUND_S)
        assert wait_for(lambda: not survivor.owned(tag), BOUND_S)
    else:
        wait_for(lambda: False, 3.0)
        assert _mounted(mp), "control: a dead FUSE server's mount stays without a survivor"
        survivor.sweep(tag)  # what the survivor does
        assert not _mounted(mp) and not os.path.exists(mp)


def test_a_bench_killed_with_its_fuse_mirror_mounted_leaves_nothing(tmp_path, tag) -> None:
    _fuse_mountable()
    env = _env(tag, tmp_path, tmp_path)
    bench = subprocess.Popen(
        [sys.executable, "-m", "preload_gate", "bench", "--only", "restart_identity", "--workdir", str(tmp_path / "w"),
         "--param", "shards=4", "--param", "shard_mb=0.05", "--param", "trip_shards=4",
         "--param", "schemes=content/stat", "--param", "latency_ms=0", "--param", "stat_latency_ms=200"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        assert wait_for(lambda: bool(survivor.mounts_of(tag)) or bench.poll() is not None, BOUND_S * 2)
        assert bench.poll() is None, bench.stderr.read() if bench.stderr else ""
        mounts = survivor.mounts_of(tag)
    finally:
        bench.kill()
        bench.wait()
    assert wait_for(lambda: not survivor.owned(tag), BOUND_S), [survivor._cmdline(p) for p in survivor.owned(tag)]
    assert wait_for(lambda: not any(_mounted(m) for m in mounts), BOUND_S)
    err = bench.stderr.read() if bench.stderr else ""
    assert "preload-gate bench (pid" in err and "its survivor stops" in err, err[-2000:]


SCRATCH_STARTER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from harness.bench import BenchOptions, scratch
    from pgbase import survivor
    if sys.argv[1] == "1":
        survivor.hold("bench")
    work = scratch(BenchOptions(workdir=Path(sys.argv[2])), "pg-bench-t-")
    (work / "shard.safetensors").write_bytes(b"x" * 4096)
    print(work, flush=True)
    time.sleep(3600)
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
@pytest.mark.parametrize("held", [True, False], ids=["held", "control-no-holder"])
def test_a_killed_bench_leaves_no_scratch(tmp_path, tag, held, sig) -> None:
    """The bench's scratch (checkpoints of up to --size, mirrors) is removed
    by its survivor when the bench is killed, by SIGTERM (no finally runs)
    or kill -9. The control: without a holder, the scratch stays."""
    workdir = tmp_path / "w"
    starter = subprocess.Popen([sys.executable, "-c", SCRATCH_STARTER, "1" if held else "0", str(workdir)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=_env(tag, tmp_path, tmp_path), cwd=REPO)
    try:
        work = Path(_readline(starter))
        assert work.is_dir() and work.parent == workdir
    finally:
        starter.send_signal(sig)
        starter.wait()
    if held:
        assert wait_for(lambda: not work.exists(), BOUND_S), "the survivor left the scratch"
        err = starter.stderr.read() if starter.stderr else ""
        assert wait_for(lambda: not list(tmp_path.glob("pg-scratch-*.list")), BOUND_S)
        assert "its survivor removes its scratch: " + str(work) in err, err
    else:
        wait_for(lambda: False, 2.0)
        assert work.is_dir(), "control: without a survivor the scratch stays"


# ---------------------------------------------------------------- static

_TREE = ("harness", "canaries", "preload", "preload_gate", "pgbase", "fixtures")
_STARTS = {"Popen", "run", "call", "check_call", "check_output"}
# Sites the kill -9 table runs (module:function of the call).
# (ipc_cache's prepare starts vLLM's preload through start_vllm_preload; run_engine runs run_engine_once.)
_TABLED = {"harness.targets._procs:run_all", "harness.targets.ipc_cache:start_vllm_preload",
           "canaries.golden:_run_worker", "harness.rollout.supervised:restart", "preload.daemon.ready:start_preload",
           "preload.daemon.ready:start_rank", "harness.engine:run_engine_once"}
# The one place an environment is made without the token on purpose.
_EXEMPT = {"pgbase.survivor:hold": "the survivor itself: no holder's survivor stops another"}


def _derived(node: ast.AST, fn: ast.AST, tree: ast.AST, depth: int = 0) -> bool:
    """Whether an ``env=`` value is built from ``os.environ``: it reads it, or
    is a variable of the function assigned only from such values, or a
    parameter every caller in the module passes such a value."""
    if "os.environ" in ast.unparse(node):
        return True
    if depth > 3 or not isinstance(node, ast.Name):
        return False
    sources = [a.value for a in ast.walk(fn) if isinstance(a, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == node.id for t in a.targets)]
    if sources:
        return all(_derived(v, fn, tree, depth + 1) for v in sources)
    params = [a.arg for a in fn.args.args] if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) else []
    if node.id not in params:
        return False
    index, passed = params.index(node.id), []
    for caller in ast.walk(tree):
        if not isinstance(caller, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for call in ast.walk(caller):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == fn.name:
                arg = next((k.value for k in call.keywords if k.arg == node.id), None)
                arg = arg if arg is not None else (call.args[index] if index < len(call.args) else None)
                passed.append(arg is not None and _derived(arg, caller, tree, depth + 1))
    return bool(passed) and all(passed)


def _spawn_sites() -> list[tuple[str, str, ast.Call, ast.AST, ast.AST]]:
    out = []
    for pkg in _TREE:
        for path in sorted((REPO / pkg).rglob("*.py")):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for fn in ast.walk(tree):
                if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for call in ast.walk(fn):
                    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                            and call.func.attr in _STARTS and isinstance(call.func.value, ast.Name)
                            and call.func.value.id == "subprocess"):
                        out.append((module, fn.name, call, fn, tree))
    return out


def test_every_child_environment_is_built_from_os_environ_or_tabled() -> None:
    sites = _spawn_sites()
    assert len(sites) > 10  # the scan sees the tree's spawners (control against a scan that finds none)
    escaping = []
    for module, fn_name, call, fn, tree in sites:
        site = f"{module}:{fn_name}"
        env = next((k.value for k in call.keywords if k.arg == "env"), None)
        if env is None or site in _TABLED or site in _EXEMPT or _derived(env, fn, tree):
            continue
        escaping.append(f"{site} (env={ast.unparse(env)})")
    assert not escaping, ("these start a process with an environment not built from os.environ: the survivor's "
                          f"token would not reach it; build it from os.environ or add a kill -9 case: {escaping}")
    assert _TABLED <= {f"{m}:{f}" for m, f, *_ in sites}, "a tabled site is gone: update the table"


def test_control_an_environment_from_scratch_is_found() -> None:
    def verdict(src: str) -> bool:
        tree = ast.parse(textwrap.dedent(src))
        fn = next(f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "spawn")
        call = next(c for c in ast.walk(fn) if isinstance(c, ast.Call) and ast.unparse(c.func) == "subprocess.Popen")
        return _derived(next(k.value for k in call.keywords if k.arg == "env"), fn, tree)

    assert not verdict("def spawn():\n    env = {'PATH': '/bin'}\n    subprocess.Popen(['x'], env=env)\n")
    assert verdict("def spawn():\n    env = dict(os.environ)\n    subprocess.Popen(['x'], env=env)\n")
    passed = "def spawn(cmd, env):\n    subprocess.Popen(cmd, env=env)\ndef a():\n    spawn(['x'], {**os.environ})\n"
    assert verdict(passed)
    assert not verdict(passed + "def b():\n    spawn(['y'], {'PATH': '/bin'})\n")  # one caller from scratch
