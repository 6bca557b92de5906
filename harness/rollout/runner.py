"""The rotation: every replica onto each checkpoint of the sequence, one at a time.

For each step (A -> B, then B -> C, ...):

1. the old and the new checkpoint are made resident (one daemon each;
   :mod:`harness.rollout.residency`): the old one is found or started, the
   oldest one no replica serves is evicted so at most two stay resident,
   and the new one starts only if it fits the memory budget beside what is
   held (``--evict-first`` stops the old one first, saying what it gives up);
2. each replica in turn is switched (:func:`harness.rollout.switch.switch`):
   the state file records the intent, the replica restarts onto the new
   checkpoint, must serve, must record a hit on the new key and must pass
   the new checkpoint's canary;
3. on the first failure that replica is restarted onto the old checkpoint
   (resident: a hit) and judged the same way, the rollout stops and exits 1;
   the replicas after it never left the old checkpoint;
4. after the last replica, ``soak_s`` seconds of watching every replica
   (``/health`` every two seconds, then the canary on all): a failure there
   rolls every replica back, one at a time, onto the old checkpoint;
5. the old checkpoint's daemon is released (SIGTERM to its launcher: a stop
   for good) unless ``keep_from``.

A run that finds a replica mid-switch in the state file (the previous run
was killed) finishes that one step first: a switch is redone (or, when the
process it started still runs, waited for), a rollback is completed and
the rollout ends failed as it would have. Nothing here decides a replica's
weights from anything but its own load events and answers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from canaries.golden import Golden
from harness.rollout.identity import key_mismatch
from harness.rollout.metrics import RolloutMetrics
from harness.rollout.replicas import ReplicaDriver, StartFailedError, Target, probe, wait_serving
from harness.rollout.residency import (
    DaemonStart,
    check_budget,
    find_daemon,
    release_daemon,
    resident_estimate,
    socket_dir_gone,
    start_daemon,
)
from harness.rollout.state import Checkpoint, ReplicaRecord, RolloutState, label_of, save_state
from harness.rollout.switch import SwitchOptions, SwitchResult, canary, switch
from preload.deployment import DeploymentSettings

SOAK_POLL_S = 2.0
Progress = Callable[[str, str], None]


@dataclass
class RolloutOptions:
    """How a rollout runs (the plan's checkpoints and replicas live in the state)."""

    socket_root: str
    state_path: Path
    settings: DeploymentSettings
    switch: SwitchOptions = field(default_factory=SwitchOptions)
    soak_s: float = 0.0
    keep_from: bool = False
    evict_first: bool = False
    memory_budget: int | None = None
    unsafe_identity: str | None = None  # NEGATIVE CONTROL: the targets keyed by vLLM's header hash
    abort: bool = False


class Rollout:
    """One rollout over one state file; :meth:`run` returns the exit code (0 done, 1 failed)."""

    def __init__(self, state: RolloutState, driver: ReplicaDriver, goldens: dict[str, Golden | None],
                 opts: RolloutOptions, progress: Progress | None = None, metrics: RolloutMetrics | None = None,
                 on_save: Callable[[RolloutState], None] | None = None,
                 on_ready: Callable[[], None] | None = None) -> None:
        self.state, self.driver, self.goldens, self.opts = state, driver, goldens, opts
        self.progress, self.metrics, self.on_save, self.on_ready = progress, metrics, on_save, on_ready
        self.t0 = time.monotonic()

    # -- bookkeeping --------------------------------------------------------

    def save(self) -> None:
        save_state(self.opts.state_path, self.state)
        if self.on_save is not None:
            self.on_save(self.state)
        if self.metrics is not None:
            self.metrics.update(self.state)
            self.metrics.write()

    def note(self, phase: str, message: str) -> None:
        if self.progress is not None:
            self.progress(phase, message)

    def target(self, c: Checkpoint, resident: bool = True) -> Target:
        i = self.state.sequence.index(c)
        return Target(c.path, c.ask, label_of(i), c.root(self.opts.socket_root),
                      unsafe_identity=self.opts.unsafe_identity if i > 0 else None, fallback=not resident,
                      handle=c.key)

    def _record(self, res: SwitchResult) -> None:
        self.state.switches.append(res.to_json())
        if self.metrics is not None:
            self.metrics.record_switch(res.to_json())

    def _who(self, r: ReplicaRecord) -> str:
        return f"replica {r.index}/{len(self.state.replicas)} ({r.url})"

    # -- residency ----------------------------------------------------------

    def _resident(self, c: Checkpoint) -> bool:
        """Whether a daemon serves ``c``'s key now (a recorded one that is gone is marked released)."""
        d = self.state.daemon(c.key)
        # "Resident" is a daemon of c's digest whose key is the one the
        # replicas will ask for (its config, dtype, TP), never the digest alone.
        def fits(key: dict) -> list[str]:
            return key_mismatch(key, c.config_digest, self.opts.settings)

        found = find_daemon(c.ask, c.root(self.opts.socket_root), fits, roots=[self.opts.socket_root])
        if d is not None:
            if found is not None:
                return True
            d.released = True
            self.state.notes.append(f"{self.state.label(c.key)}'s daemon pid {d.pid} is gone")
        if found is None:
            return False
        found.key = c.key
        if found.socket_root != os.path.abspath(c.root(self.opts.socket_root)):
            c.socket_root = found.socket_root
        self.state.daemons.append(found)
        self.note("resident", f"{self.state.label(c.key)} is resident (daemon pid {found.pid}, "
                              f"{found.resident_bytes} bytes)")
        return True

    def _ensure(self, c: Checkpoint) -> None:
        if not self._resident(c):
            self._start(c)

    def _start(self, c: Checkpoint) -> None:
        label = self.state.label(c.key)
        self.note("preload", f"starting the daemon for {label} ({c.path}, {c.ask[:16]})")
        i = self.state.sequence.index(c)
        os.makedirs(c.root(self.opts.socket_root), mode=0o700, exist_ok=True)
        d = start_daemon(DaemonStart(c.path, c.ask, c.root(self.opts.socket_root), self.opts.settings,
                                     self.opts.state_path.parent / f"daemon-{c.key[:16]}.log",
                                     unsafe_identity=self.opts.unsafe_identity if i > 0 else None))
        d.key = c.key
        self.state.daemons.append(d)
        self.note("preload", f"{label} resident: daemon pid {d.pid}, {d.resident_bytes} bytes")
        self.save()

    def _release(self, key: str, why: str) -> None:
        d = self.state.daemon(key)
        if d is None:
            return
        self.note("release", f"releasing {self.state.label(key)}'s daemon (pid {d.pid}): {why}")
        gone = release_daemon(d)
        d.released = gone
        self.state.notes.append(f"{self.state.label(key)}'s daemon pid {d.pid} released ({why}); "
                                + ("its socket directory is gone" if gone and socket_dir_gone(d) else
                                   "it did not stop within the deadline" if not gone else
                                   "its socket directory is still there"))
        self.save()

    def make_resident(self, src: Checkpoint, dst: Checkpoint) -> bool:
        """Both ends of a step resident; returns whether ``src`` is (``--evict-first`` gives it up)."""
        self._ensure(src)
        serving = {r.serving for r in self.state.replicas}
        for d in list(self.state.daemons):  # rotation: at most two resident, the oldest goes first
            if not d.released and d.key not in (src.key, dst.key) and d.key not in serving:
                self._release(d.key, "no replica serves it and at most two checkpoints stay resident")
        if self._resident(dst):
            return True
        if self.opts.evict_first:
            self.state.notes.append(f"--evict-first: {self.state.label(src.key)}'s daemon stopped before "
                                    f"{self.state.label(dst.key)} was preloaded; a rollback reloads it from disk "
                                    "(a loud miss, not a hit), and the replicas still on it keep their own mapped copy")
            self._release(src.key, "--evict-first")
        held = [(self.state.label(d.digest), d.resident_bytes) for d in self.state.daemons if not d.released]
        need = resident_estimate(dst.path, self.opts.settings)
        line = check_budget(f"{self.state.label(dst.key)} ({dst.path})", need, held, self.opts.memory_budget)
        self.state.notes.append(f"memory: {line}")
        self._start(dst)
        return not self.opts.evict_first

    # -- one replica --------------------------------------------------------

    def _switch(self, r: ReplicaRecord, c: Checkpoint, rollback: bool = False, adopt: bool = False,
                resident: bool = True) -> SwitchResult:
        label = self.state.label(c.key)
        phase = "rolling_back" if rollback else "switching"
        before = r.serving
        self.state.mark(r, phase, None if rollback else before, c.key, note=f"onto {label}")
        self.save()
        self.note("rollback" if rollback else "switch", f"{self._who(r)}: restart onto {label}"
                  + (" (waiting for the start a killed run began)" if adopt else ""))
        res = switch(self.driver, r, self.target(c, resident), self.goldens.get(c.key), self.opts.switch,
                     self.save, adopt=adopt)
        res.rollback = rollback
        self._record(res)
        if res.ok:
            self.state.mark(r, "serving", c.key, note=f"serving {label}")
            self.note("serving", f"{self._who(r)}: serves {label} ({res.detail[:120]}; "
                                 f"{res.seconds.get('switch', 0):.1f} s)")
        elif rollback:
            self.driver.stop(r)  # whatever it runs now is on weights nobody can name: gone, not left starting
            self.state.mark(r, "down", None, note=f"rollback onto {label} failed: {res.reason}")
            self.note("down", f"{self._who(r)}: rollback onto {label} FAILED: {res.reason}: {res.detail[:200]}")
        else:
            # It serves nothing known until the rollback below decides.
            self.state.mark(r, "rolling_back", None, before, note=f"{label} failed: {res.reason}")
            self.note("failed", f"{self._who(r)}: {label} FAILED: {res.reason}: {res.detail[:300]}")
        self.save()
        return res

    def _fail(self, r: ReplicaRecord, res: SwitchResult, src: Checkpoint, dst: Checkpoint,
              src_resident: bool) -> int:
        rb = self._switch(r, src, rollback=True, resident=src_resident)
        for x in self.state.replicas:  # the ones that had moved go back too: the fleet is back on src
            if x is not r and x.serving == dst.key:
                self._switch(x, src, rollback=True, resident=src_resident)
        self._finish_failed(r, res, src, dst, rb)
        return 1

    def _finish_failed(self, r: ReplicaRecord | None, res: SwitchResult | None, src: Checkpoint,
                       dst: Checkpoint, rb: SwitchResult | None, why: str = "") -> None:
        s = self.state
        back = all(x.serving == src.key and x.phase == "serving" for x in s.replicas)
        src_l, dst_l = s.label(src.key), s.label(dst.key)
        fleet = (f"the fleet is back on {src_l}" if back else
                 "NOT all replicas are back on " + src_l + ": " + ", ".join(
                     f"replica {x.index} serves {s.label(x.serving)}" for x in s.replicas if x.serving != src.key))
        hit = rb is not None and rb.ok and any(e.get("outcome") == "hit" for e in rb.events)
        s.failure = {
            "replica": None if r is None else r.index, "url": None if r is None else r.url,
            "onto": dst_l, "reason": why or (res.reason if res else ""), "detail": res.detail if res else why,
            "rollback": None if rb is None else {"ok": rb.ok, "reason": rb.reason, "detail": rb.detail,
                                                  "hit": hit, "seconds": rb.seconds},
            "fleet_back_on_from": back, "fleet": fleet,
        }
        s.status = "failed"
        serving = {x.serving for x in s.replicas}
        d = s.daemon(dst.key)
        if d is not None and d.started_here and dst.key not in serving:
            self._release(dst.key, f"no replica serves {dst_l} after the failure")
        self.save()
        what = f"replica {r.index} failed on {dst_l}" if r is not None else f"{dst_l} failed"
        how = f"{res.reason}: {res.detail}" if res else why
        back_as = (f"; replica {r.index} is back on {src_l}" + (" (a hit)" if hit else "")) if r is not None and rb and rb.ok else ""
        self.note("failed", f"{what} ({how[:300]}){back_as}; {fleet}")

    # -- phases -------------------------------------------------------------

    def recover(self) -> bool:
        """Settle the replica a killed run left mid-switch; False when the rollout ends failed."""
        s = self.state
        for r in s.unknown():
            c = s.checkpoint(r.target)
            if c is None:
                raise StartFailedError("start_failed", f"replica {r.index} is mid-switch onto {r.target}, "
                                                       "which is not in this rollout's sequence")
            adopt = r.started_onto == r.target and self.driver.alive(r) is True
            i = s.sequence.index(c)
            self.note("resume", f"{self._who(r)} was {r.phase.replace('_', ' ')} onto {s.label(c.key)} "
                                f"when the last run stopped; " + ("waiting for the process it started" if adopt
                                                                  else "restarting it"))
            if r.phase == "switching":
                src = s.sequence[i - 1]
                src_resident = self.make_resident(src, c)
                res = self._switch(r, c, adopt=adopt)
                if not res.ok:
                    self._fail(r, res, src, c, src_resident)
                    return False
            else:
                res = self._switch(r, c, rollback=True, adopt=adopt, resident=self._resident(c))
                dst = s.sequence[min(i + 1, len(s.sequence) - 1)]
                prior = s.failure or {}
                self._finish_failed(r, None, c, dst, res, why=f"resumed a rollback after: {prior.get('reason') or 'a failure'}")
                return False
        return True

    def bring_up(self) -> bool:
        """Replicas that serve nothing (new to the state file, or down) start on this step's first checkpoint.

        They start together (no replica serves anything yet, so there is no
        fleet to keep up), each marked ``starting``: it serves that
        checkpoint or nothing, never unknown weights.
        """
        from harness.rollout.replicas import count_events

        s = self.state
        src = s.sequence[s.step - 1]
        new = [r for r in s.replicas if r.serving is None and r.phase in ("serving", "starting", "down")]
        if not new:
            return True
        self._ensure(src)
        for r in new:
            adopt = r.phase == "starting" and r.started_onto == src.key and self.driver.alive(r) is True
            self.note("bring-up", f"{self._who(r)}: starting on {s.label(src.key)}"
                      + (" (waiting for the start a killed run began)" if adopt else ""))
            s.mark(r, "starting", None, src.key, note="bring-up")
            self.save()
            if adopt:
                continue
            try:
                r.events_seen, r.started_onto = count_events(r), None
                self.driver.restart(r, self.target(src), self.save)
                r.started_onto = src.key
                self.save()
            except StartFailedError as exc:
                return self._bring_up_failed(r, src, exc.reason, exc.detail)
        for r in new:
            try:
                wait_serving(self.driver, r, self.target(src), r.events_seen, self.opts.switch.ready_timeout_s)
            except StartFailedError as exc:
                return self._bring_up_failed(r, src, exc.reason, exc.detail)
            golden = self.goldens.get(src.key)
            if golden is not None:
                ok, reason, detail, _ = canary(r.url, golden, self.opts.switch)
                if not ok:
                    return self._bring_up_failed(r, src, reason, detail)
            s.mark(r, "serving", src.key, note=f"serving {s.label(src.key)}")
            self.note("serving", f"{self._who(r)}: serves {s.label(src.key)}")
            self.save()
        return True

    def _bring_up_failed(self, r: ReplicaRecord, src: Checkpoint, reason: str, detail: str) -> bool:
        self.driver.stop(r)
        self.state.mark(r, "down", None, note=f"bring-up failed: {reason}")
        self.state.status = "failed"
        self.state.failure = {"replica": r.index, "url": r.url, "onto": self.state.label(src.key), "reason": reason,
                              "detail": detail, "rollback": None, "fleet_back_on_from": False,
                              "fleet": f"replica {r.index} did not come up on {self.state.label(src.key)}"}
        self.save()
        self.note("failed", f"{self._who(r)}: bring-up onto {self.state.label(src.key)} failed: {reason}: {detail[:300]}")
        return False

    def soak(self, src: Checkpoint, dst: Checkpoint, src_resident: bool) -> bool:
        """Watch the fleet on ``dst``; on a failure roll every replica back onto ``src``."""
        s = self.state
        problem: tuple[ReplicaRecord, str, str] | None = None
        if self.opts.soak_s > 0:
            self.note("soak", f"every replica serves {s.label(dst.key)}; soaking {self.opts.soak_s:g} s")
            end = time.monotonic() + self.opts.soak_s
            while problem is None and time.monotonic() < end:
                for r in s.replicas:
                    if probe(r.url) is None:
                        problem = (r, "not_ready", "stopped answering /health or /v1/models during the soak")
                        break
                time.sleep(min(SOAK_POLL_S, max(0.0, end - time.monotonic())))
            golden = self.goldens.get(dst.key)
            for r in s.replicas:
                if problem is not None or golden is None:
                    break
                ok, reason, detail, _ = canary(r.url, golden, self.opts.switch)
                if not ok:
                    problem = (r, reason, f"after the soak: {detail}")
        if problem is None:
            return True
        r, reason, detail = problem
        res = SwitchResult(r.index, s.label(dst.key), dst.key, ok=False, reason=reason, detail=detail)
        self.note("failed", f"{self._who(r)}: {reason} during the soak: {detail[:200]}; rolling every replica back")
        rb = None
        for x in s.replicas:
            if x.serving == dst.key:
                got = self._switch(x, src, rollback=True, resident=src_resident)
                rb = got if x is r else rb
        self._finish_failed(r, res, src, dst, rb)
        return False

    def abort(self) -> int:
        """``--abort``: every replica back onto the first checkpoint of the current step."""
        s = self.state
        src, dst = s.sequence[s.step - 1], s.sequence[s.step]
        self._ensure(src)
        for r in s.replicas:
            if r.serving != src.key or r.phase != "serving":
                self._switch(r, src, rollback=True)
        self._finish_failed(None, None, src, dst, None, why="aborted by the operator (--abort)")
        return 1

    def run(self) -> int:
        s = self.state
        self.save()
        if self.opts.abort:
            return self.abort()
        if not self.bring_up():
            return 1
        if self.on_ready is not None:  # the fleet serves (one replica perhaps mid-switch): load starts here
            self.on_ready()
        if not self.recover():
            return 1
        while True:
            src, dst = s.sequence[s.step - 1], s.sequence[s.step]
            self.note("step", f"{s.label(src.key)} -> {s.label(dst.key)}: {dst.path} ({dst.ask[:16]})")
            src_resident = self.make_resident(src, dst)
            for r in s.replicas:
                if r.serving == dst.key:
                    continue  # done by an earlier run of this rollout
                res = self._switch(r, dst)
                if not res.ok:
                    return self._fail(r, res, src, dst, src_resident)
            if not self.soak(src, dst, src_resident):
                return 1
            last = s.step == len(s.sequence) - 1
            if not self.opts.keep_from:
                self._release(src.key, f"every replica left {s.label(src.key)}")
            if last:
                break
            s.step += 1
            self.save()
        s.status = "done"
        self.save()
        self.note("done", f"every replica serves {s.label(s.sequence[-1].key)} "
                          f"({time.monotonic() - self.t0:.0f} s)")
        return 0

