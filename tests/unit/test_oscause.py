"""Library and OS failures named by their real cause, as a table (pgbase.oscause).

Two tables. The first makes each failure really happen, through the readers
a user's command goes through (``read_header``: the safetensors library, then
our own open; ``hash_file``: our open), in a subprocess where a limit is
lowered (RLIMIT_NOFILE with every descriptor taken, RLIMIT_AS just above what
is mapped, another uid): each row has a control that differs in that one
thing and must read fine or get another cause. safetensors 0.8 words EMFILE
and EACCES as "No such file or directory" and a failed mmap as MemoryError:
the rows where its word and the real cause differ are the point.

The second feeds :func:`explain` the shapes of exception that cannot be made
on demand (ENFILE, ENOSPC, torch's allocator failure, ...), one row per
cause kind; a last check holds that every kind has a row.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from daemon_support import repo_pythonpath
from reliability_support import skip_privileged
from safetensors.numpy import save_file

from pgbase import oscause
from pgbase.oscause import explain, reason

pytestmark = pytest.mark.unit

# Runs one reader on one path under one setup; prints {"ok"} or {"message"}.
WORKER = r"""
import json, os, resource, sys
import psutil, safetensors, safetensors.numpy  # imported before any limit is lowered
from pgbase.errors import CheckpointError
from pgbase.shards import read_header
from preload.identity.digest import hash_file
setup, reader, path = sys.argv[1:4]
held = []
if setup == "fds_taken":
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
elif setup == "address_space":
    vms = psutil.Process().memory_info().vms
    resource.setrlimit(resource.RLIMIT_AS, (vms + (16 << 20), resource.RLIM_INFINITY))
elif setup == "other_uid":
    os.setegid(65534)
    os.seteuid(65534)
try:
    (read_header if reader == "read_header" else hash_file)(path)
    out = {"ok": True}
except CheckpointError as exc:
    out = {"ok": False, "message": str(exc)}
for fd in held:
    os.close(fd)
print(json.dumps(out))
"""


def run_reader(setup: str, reader: str, path: str) -> dict:
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    cp = subprocess.run([sys.executable, "-c", WORKER, setup, reader, path], capture_output=True, text=True,
                        env=env, timeout=60)
    assert cp.returncode == 0, cp.stderr[-3000:]
    return json.loads(cp.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def files():
    # Not under pytest's 0700 tmp root: the other uid must reach the files.
    d = Path(tempfile.mkdtemp(prefix="pg-causes-", dir="/tmp"))
    os.chmod(d, 0o755)
    small = d / "small.safetensors"
    save_file({"w": np.arange(64, dtype=np.float32)}, str(small))
    big = d / "big.safetensors"  # larger than RLIMIT_AS leaves room for: its mmap fails
    save_file({"w": np.zeros(64 << 20, dtype=np.uint8)}, str(big))
    secret = d / "secret.safetensors"
    save_file({"w": np.arange(8, dtype=np.float32)}, str(secret))
    os.chmod(secret, 0o600)
    bad = d / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    (d / "dir.safetensors").mkdir()
    locked = d / "locked"
    locked.mkdir(mode=0o700)
    save_file({"w": np.arange(8, dtype=np.float32)}, str(locked / "inner.safetensors"))
    for p in (small, big, bad):
        os.chmod(p, 0o644)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _other_uid_denied() -> bool:
    return os.geteuid() == 0  # root can become another uid; as anyone else chmod 000 is the same test


# (id, setup, reader, file, words the message must hold, words it must not)
REAL = [
    ("library open at EMFILE -> the open-file limit, not 'no such file'", "fds_taken", "read_header",
     "small.safetensors", ["open-file limit", "RLIMIT_NOFILE", "ulimit -n", "LimitNOFILE="], ["No such file"]),
    ("our open at EMFILE -> the open-file limit", "fds_taken", "hash_file", "small.safetensors",
     ["open-file limit", "ulimit -n", "LimitNOFILE="], ["Too many open files"]),
    ("library mmap past RLIMIT_AS -> memory, not 'not a valid safetensors file'", "address_space",
     "read_header", "big.safetensors", ["out of memory", "RLIMIT_AS"], ["not a valid safetensors"]),
    ("library open of another uid's 0600 file -> permission, not 'no such file'", "other_uid", "read_header",
     "secret.safetensors", ["Permission denied", "cannot open", "mode 0600"], ["No such file", "does not exist"]),
    ("library open below another uid's 0700 directory -> permission, naming the directory", "other_uid",
     "read_header", "locked/inner.safetensors", ["Permission denied", "cannot enter", "locked", "mode 0700"],
     ["No such file", "does not exist"]),
    ("a file that really is missing -> missing", "none", "read_header", "gone.safetensors",
     ["does not exist"], ["open-file limit", "Permission"]),
    ("a directory in a shard's place -> not a regular file", "none", "read_header", "dir.safetensors",
     ["is a directory, not a regular file"], ["not a valid safetensors", "No such device"]),
    ("a file the library refuses -> the library's verdict, kept", "none", "read_header", "bad.safetensors",
     ["not a valid safetensors file"], ["open-file limit", "does not exist"]),
]
# Each row's control: the same reader and file with the one cause taken away.
CONTROLS = {
    REAL[0][0]: ("none", "small.safetensors"),
    REAL[1][0]: ("none", "small.safetensors"),
    REAL[2][0]: ("none", "big.safetensors"),
    REAL[3][0]: ("none", "secret.safetensors"),
    REAL[4][0]: ("none", "locked/inner.safetensors"),
    REAL[5][0]: ("none", "small.safetensors"),
    REAL[6][0]: ("none", "small.safetensors"),
    REAL[7][0]: ("none", "small.safetensors"),
}


@pytest.mark.parametrize("name,setup,reader,file,want,unwanted", REAL, ids=[r[0] for r in REAL])
def test_real_failure_named_by_its_cause(files, name, setup, reader, file, want, unwanted):
    if setup == "other_uid" and not _other_uid_denied():
        if "/" in file:
            skip_privileged("a directory another uid cannot enter needs root to make the other uid")
        os.chmod(files / file, 0)  # as a non-root user, chmod 000 is the same denial
        setup = "none"
    got = run_reader(setup, reader, str(files / file))
    assert not got["ok"], got
    message = got["message"]
    assert message.startswith(f"{Path(file).name}: "), message  # which shard, first
    for w in want:
        assert w in message, (w, message)
    for w in unwanted:
        assert w not in message, (w, message)
    assert "\n" not in message


@pytest.mark.parametrize("name", list(CONTROLS), ids=list(CONTROLS))
def test_control_reads_fine_without_the_cause(files, name):
    setup, file = CONTROLS[name]
    reader = next(r[2] for r in REAL if r[0] == name)
    assert run_reader(setup, reader, str(files / file)) == {"ok": True}


# (id, exception, path or None, kind, words in the text)
SHAPES = [
    ("EMFILE from our own open", OSError(errno.EMFILE, "Too many open files"), None, oscause.OPEN_FILES,
     ["open-file limit", "LimitNOFILE="]),
    ("ENFILE is the system's table, not ours", OSError(errno.ENFILE, "Too many open files in system"), None,
     oscause.SYSTEM_FILES, ["system-wide", "fs.file-max"]),
    ("a MemoryError carrying Rust's os error 12", MemoryError("Cannot allocate memory (os error 12)"), None,
     oscause.MEMORY, ["out of memory"]),
    ("torch's CPU allocator", RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                                          "1099511627776 bytes"), None, oscause.MEMORY, ["out of memory"]),
    ("EACCES from our own open", PermissionError(errno.EACCES, "Permission denied"), "/", oscause.PERMISSION,
     ["Permission denied", "uid"]),
    ("ENOENT from our own open", FileNotFoundError(errno.ENOENT, "No such file"), "/nonexistent/x",
     oscause.MISSING, ["/nonexistent/x does not exist", "its directory /nonexistent does not exist"]),
    ("a directory mapped", OSError("No such device (os error 19)"), "/", oscause.NOT_A_FILE, ["a directory"]),
    ("ENOSPC", OSError(errno.ENOSPC, "No space left on device"), None, oscause.NO_SPACE, ["free space"]),
    ("EROFS", OSError(errno.EROFS, "Read-only file system"), "/x", oscause.READ_ONLY, ["read-only"]),
    ("EIO", OSError(errno.EIO, "Input/output error"), None, oscause.IO, ["Input/output error from the storage", "dmesg"]),
    ("a library error that is no OS error", ValueError("header too large"), "/", oscause.OTHER,
     ["header too large"]),
]


@pytest.mark.parametrize("name,exc,path,kind,words", SHAPES, ids=[r[0] for r in SHAPES])
def test_explain_by_shape(name, exc, path, kind, words):
    cause = explain(exc, path)
    assert cause.kind == kind, cause
    for w in words:
        assert w in cause.text, (w, cause.text)


def test_every_kind_has_a_row():
    assert {r[3] for r in SHAPES} == set(oscause.KINDS)


def test_library_no_such_file_for_a_file_that_opens_says_so(files):
    """safetensors' FileNotFoundError (no errno) for a file that exists and
    opens now: neither "missing" nor a guessed limit, but what was seen."""
    path = files / "small.safetensors"
    cause = explain(FileNotFoundError(f"No such file or directory: {path}"), path)
    assert cause.kind == oscause.OTHER and "exists and opens now" in cause.text, cause
    # Control: the same claim for a file that really is missing is believed.
    assert explain(FileNotFoundError("No such file or directory"), files / "gone").kind == oscause.MISSING


def test_reason_keeps_the_type_of_what_is_no_os_failure():
    assert reason(KeyError("model.norm")) == "KeyError: 'model.norm'"
    assert "open-file limit" in reason(OSError(errno.EMFILE, "Too many open files"))


@pytest.mark.parametrize("soft, want", [(12, 1024), (256, 1024), (4096, 8192)])
def test_emfile_fix_is_a_number_to_paste(soft: int, want: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """An EMFILE whose need is unknown still gives a limit to paste (twice the
    soft limit, at least systemd's 1024), never the placeholder ``N``; a
    caller that counted the need gives that. Control: a counted need wins."""
    import pgbase.limits

    monkeypatch.setattr(pgbase.limits, "open_file_limit", lambda: (soft, 1 << 62))
    text = explain(OSError(errno.EMFILE, "Too many open files")).text
    assert f"`ulimit -n {want}`" in text and f"`LimitNOFILE={want}`" in text, text
    assert "-n N`" not in text and "=N`" not in text
    assert "`ulimit -n 37`" in pgbase.limits.nofile_fix(37)


def _real_error(op, path) -> OSError:
    try:
        op(path)
    except OSError as exc:
        return exc
    raise AssertionError(f"{op.__name__}({path}) did not fail")


def _proc_mkdir_enoent() -> OSError:
    exc = _real_error(os.mkdir, "/proc/pg-no-such-entry")
    if exc.errno != errno.ENOENT:
        pytest.skip(f"mkdir in /proc fails here with {errno.errorcode.get(exc.errno or 0)}, not ENOENT")
    return exc


def _in_proc(t):
    return _proc_mkdir_enoent(), "/proc"


def _below_missing(t):
    return _real_error(os.mkdir, t / "gone" / "deeper" / "x"), t / "gone" / "deeper" / "x"


def _below_broken_link(t):
    os.symlink(t / "nowhere", t / "link")
    return _real_error(os.mkdir, t / "link" / "x"), t / "link" / "x"


def _below_file(t):
    (t / "afile").write_text("x")
    return _real_error(os.mkdir, t / "afile" / "x"), t / "afile" / "x"


def _file_missing(t):
    return _real_error(open, t / "nofile"), t / "nofile"


def _made_since(t):
    exc = _real_error(open, t / "late")
    (t / "late").write_text("x")
    return exc, t / "late"


# What an ENOENT (or ENOTDIR) really was, checked against the files: each row
# makes the failure with a real call on real files, then names the path the
# caller names (a mkdir probe names the directory it made an entry in).
# (id, setup(tmp) -> (exception, path), words, words it must not hold)
MISSING_ROWS = [
    ("mkdir in /proc: every ancestor exists, the directory refuses the entry", _in_proc,
     ["/proc exists but refuses new entries", "a virtual filesystem: proc"], ["does not exist"]),
    # Control for the row above: an ancestor really is missing, and is named.
    ("an ancestor really missing -> that ancestor, not its parent or the file", _below_missing,
     ["does not exist: its directory {t}/gone does not exist"], ["refuses", "{t}/gone/deeper does not"]),
    ("an ancestor that is a broken symlink -> the link and its target", _below_broken_link,
     ["{t}/link/x does not exist: {t}/link is a symlink to {t}/nowhere, which does not exist"], ["refuses"]),
    ("an ancestor that is a file -> ENOTDIR names the file", _below_file,
     ["{t}/afile is a regular file, not a directory"], ["refuses", "{t}/afile does not exist"]),
    ("the file itself missing -> the file", _file_missing, ["{t}/nofile does not exist"], ["its directory", "refuses"]),
    ("missing then made before the check -> says it exists now, not 'missing'", _made_since,
     ["yet it exists when checked now"], ["does not exist"]),
]


@pytest.mark.parametrize("name,setup,want,unwanted", MISSING_ROWS, ids=[r[0] for r in MISSING_ROWS])
def test_missing_is_checked_against_each_ancestor(tmp_path, name, setup, want, unwanted):
    exc, path = setup(tmp_path)
    assert exc.errno in (errno.ENOENT, errno.ENOTDIR), exc
    cause = explain(exc, path)
    assert cause.kind == oscause.MISSING, cause
    for w in want:
        assert w.format(t=tmp_path) in cause.text, (w, cause.text)
    for w in unwanted:
        assert w.format(t=tmp_path) not in cause.text, (w, cause.text)


def test_output_dir_under_proc_names_the_refusal_not_a_missing_proc():
    """The CLI's probe (``fixtures tiny /proc/foo``, ``gate --report``,
    ``--socket-root``): was "/proc does not exist"."""
    from pgbase.errors import PreflightError
    from pgbase.outdir import check_output_dir

    _proc_mkdir_enoent()
    with pytest.raises(PreflightError) as e:
        check_output_dir("/proc/pg-no-such-out", "OUT")
    assert "/proc exists but refuses new entries (a virtual filesystem: proc)" in str(e.value), e.value
    assert "does not exist" not in str(e.value)
