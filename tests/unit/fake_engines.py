"""Stand-in engines for the gate's own walk, for unit tests that must not start vLLM.

``python -m fake_engines SPEC OUT`` is run by :func:`harness.engine.run_engine`
in place of :mod:`harness.engine_worker` (a target's ``engine_worker`` /
``reference_worker``). It reads no weight byte:

- ``auto``: fixed greedy tokens and logprobs.
- ``verified_cache``: the loader's identity check as the real loader makes it
  (``resolve_digest`` in stat mode: the promotion's manifest and one stat per
  shard), then a hit event naming that digest and the one the stand-in daemon
  recorded in its socket root (:class:`FakeDaemon`), written to the events
  file the gate gave the engine; the same tokens.

``FAKE_ENGINE_SLEEP_S`` (seconds) keeps an engine busy before it answers: a
run that a test interrupts (a node removed under it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DAEMON_FILE = "fake-daemon.json"
TOKENS = [[11, 12, 13], [21, 22, 23]]


@dataclass
class FakeDaemon:
    """In place of :class:`harness.daemon_process.DaemonProcess`: takes the
    digest from the manifest (stat check) as the real daemon does, reads no
    weight byte, and records it in the socket root for :func:`engine`."""

    checkpoint: str
    socket_root: str
    log_path: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    ready: dict[str, Any] = field(default_factory=dict)
    start_seconds: float = 0.0

    def start(self, timeout_s: float = 0.0) -> FakeDaemon:
        from preload.identity.manifest import resolve_digest

        digest = resolve_digest(self.checkpoint, mode="stat").digest
        self.ready = {"digest": digest}
        Path(self.socket_root, DAEMON_FILE).write_text(json.dumps({"digest": digest}))
        return self

    @property
    def digest(self) -> str:
        return str(self.ready.get("digest", ""))

    def stop(self) -> None:
        Path(self.socket_root, DAEMON_FILE).unlink(missing_ok=True)


def engine(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    time.sleep(float(os.environ.get("FAKE_ENGINE_SLEEP_S", "0")))
    if spec["load_format"] == "verified_cache":
        from preload.identity.manifest import resolve_digest

        extra = spec["extra_config"]
        digest = resolve_digest(spec["checkpoint"], mode="stat").digest
        daemon = json.loads(Path(extra["socket_root"], DAEMON_FILE).read_text())["digest"]
        outcome = "hit" if digest == daemon else "miss"
        event = {"outcome": outcome, "reason": "" if outcome == "hit" else "digest differs",
                 "fields": [] if outcome == "hit" else ["checkpoint_digest"], "digest": digest,
                 "daemon_digest": daemon, "mode": "zero_copy", "seconds": 0.01, "tensors": 1, "bytes": 0,
                 "rank": 0}
        with open(extra.get("events_file") or os.environ["PRELOAD_GATE_EVENTS"], "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")
    Path(out_path).write_text(json.dumps({
        "ok": True, "token_ids": TOKENS, "texts": ["fake"] * len(TOKENS),
        "logprobs": [[{str(t): -0.5} for t in row] for row in TOKENS],
        "marks": {"imported": 0.1, "ready": 0.2, "first_token": 0.3, "done": 0.4}, "vllm_version": "0.32.0",
    }))


if __name__ == "__main__":
    engine(sys.argv[1], sys.argv[2])
