"""Child scripts run under an exact open-file limit (tests of preload.budget).

``PRELUDE`` gives a child ``limit_to(give)``: the soft (and hard) limit set so
that exactly ``give`` descriptor numbers are free below it, counted from
``/proc/self/fd`` (a descriptor numbered above the limit takes no room: the
kernel hands out the lowest free number below the soft limit, or EMFILE),
and ``report(**out)``: one JSON line with the number of Python-level opens of
the watched checkpoint's ``*.safetensors`` (an audit hook; the safetensors
library opens from Rust, unseen, but only ever in a ProvenShard or a reader
that opens the file from Python right after).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from daemon_support import repo_pythonpath

PRELUDE = r"""
import json, os, resource, sys
opened = []
WATCH = os.environ.get("WATCH_DIR") or "/nonexistent"  # the checkpoint's shards, not a probe file
def _count(event, args):
    if event == "open" and str(args[0]).startswith(WATCH) and str(args[0]).endswith(".safetensors"):
        opened.append(str(args[0]))
sys.addaudithook(_count)
def _taken():
    out = set()
    for n in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(n))  # the listing's own descriptor is closed by now
        except OSError:
            continue
        out.add(int(n))
    return out
def limit_to(give, hard_extra=0):
    # hard_extra None: the hard limit stays (an unprivileged process cannot raise it back)
    taken, soft, free = _taken(), 0, 0
    while free < give or soft in taken:  # through the taken numbers after the last free one
        free += soft not in taken
        soft += 1
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1] if hard_extra is None else soft + hard_extra
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft
def report(**out):
    out["shard_opens"] = len(opened)
    print(json.dumps(out), flush=True)
"""


def run_child(script: str, *args: object, cache: os.PathLike[str] | None = None,
              timeout: float = 120) -> tuple[dict, str]:
    """Run ``script ARGS`` and return its last JSON line and its stderr; the
    first argument is the checkpoint whose shard opens are counted."""
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "WATCH_DIR": str(args[0]) if args else ""}
    if cache is not None:
        env["PRELOAD_GATE_CACHE"] = str(cache)
    cp = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                        env=env, timeout=timeout, cwd="/")
    assert cp.returncode == 0, cp.stderr[-3000:]
    return json.loads(cp.stdout.strip().splitlines()[-1]), cp.stderr
