"""``preload-gate preload --dry-run``: the plan, and who holds its ranks now.

A dry run asks "what would a start do": the rank placement, the digest and
where it came from. A daemon already serving one of those ranks (the same
digest under the same socket root, e.g. a TP=1 daemon on rank 0 while a TP=2
start is planned) does not make the plan wrong, it makes a start refuse; so
the dry run reports the plan with each held rank's holder (pid, what it
serves, since when) and says what a start would need, where a start
refuses by the same checks (:func:`preload.daemon.launcher.preflight`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TextIO

from preload.daemon import launcher
from preload.daemon.lock import socket_answers
from preload.sockets import socket_path


def _holder(sdir: Path, rank: int, pid: str | None) -> dict[str, Any] | None:
    """The daemon holding ``rank`` in ``sdir``, from its lock's pid and its
    own ``stats`` answer; None when nothing holds it. A socket that answers
    without a lock holder (a cleaner removed the lock file) holds it too, as
    a start sees it (:meth:`preload.daemon.lock.RankLock.acquire`)."""
    sock = socket_path(sdir, rank)
    stats = None
    if sock.exists() and socket_answers(sock):
        # The client imports torch: only for a live socket.
        from preload.daemon.health import rank_stats

        stats = rank_stats(sock)
    if pid is None and stats is None:
        return None
    out: dict[str, Any] = {"global_rank": rank, "pid": int(stats["pid"]) if stats else pid, "socket": str(sock)}
    if stats:
        key = stats.get("key") or {}
        started = time.time() - float(stats.get("uptime_s") or 0.0)
        out.update({
            "checkpoint": stats.get("checkpoint"), "digest": stats.get("digest"), "stage": stats.get("stage"),
            "tp_size": key.get("tp_size"), "pp_size": key.get("pp_size"),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "attached": stats.get("attached"),
        })
    return out


def plan_with_holders(opts: launcher.PreloadOptions) -> dict[str, Any]:
    """The start's checks, then :func:`launcher.plan` with ``held``: one row
    per planned rank another daemon serves (empty when a start would go
    ahead). Raises what a start raises for anything else."""
    pids = launcher.preflight(opts, refuse_held=False)
    plan = launcher.plan(opts)
    held: list[dict[str, Any]] = []
    if plan["socket_dir"]:
        sdir = Path(plan["socket_dir"])
        for r in plan["ranks"]:
            h = _holder(sdir, r["global_rank"], pids.get(r["global_rank"]))
            if h is not None:
                held.append(h)
    plan["held"] = held
    return plan


def _held_line(h: dict[str, Any]) -> str:
    if "since" not in h:  # a live lock whose daemon does not answer (still loading, or hung)
        return f"held by pid {h['pid']} (not answering on {h['socket']}: loading, or hung)"
    return (f"held by pid {h['pid']} (TP={h['tp_size']} PP={h['pp_size']}, stage {h['stage']}, "
            f"{h['attached']} engines attached, serving since {h['since']})")


def write(plan: dict[str, Any], as_json: bool, out: TextIO) -> None:
    """The plan as JSON (one object), or as lines for people."""
    if as_json:
        out.write(json.dumps(plan) + "\n")
        return
    held = {h["global_rank"]: h for h in plan["held"]}
    out.write(f"checkpoint {plan['checkpoint']}  stage {plan['stage']}  transport {plan['transport']}\n")
    out.write(f"digest     {plan['expected_digest'] or '(from the bytes read)'}  ({plan['digest_source']})\n")
    for r in plan["ranks"]:
        h = held.get(r["global_rank"])
        out.write(f"  local {r['local_rank']}: global {r['global_rank']} "
                  f"(dp {r['dp_rank']}, pp {r['pp_rank']}, tp {r['tp_rank']})"
                  + (f"  {_held_line(h)}" if h else "") + "\n")
    if held:
        ranks = ", ".join(str(g) for g in held)
        pids = ", ".join(sorted({str(h["pid"]) for h in held.values()}))
        out.write(f"a start now would refuse: {'rank' if len(held) == 1 else 'ranks'} {ranks} of "
                  f"{plan['socket_dir']} {'is' if len(held) == 1 else 'are'} served by pid {pids}; "
                  f"stop that daemon first (preload-gate status lists every rank)\n")
