"""What content a replica claims to serve, from a source other than its answers.

A golden file is only a fair yardstick for a replica that serves the same
content. The claim comes from the operator (``--expect-digest``), from the
replica's own load event (``--events-file``: the ``verified_cache`` loader
appends one JSON line per load), or from the daemon's ``/metrics``
(``--metrics-url``: every serving rank carries a ``digest`` label).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from canaries.errors import GoldenError, read_digest
from preload.events import read_events
from preload.trust import UntrustedPathError

_RANK_UP = "preload_gate_rank_up"


@dataclass(frozen=True)
class Claim:
    """A digest a replica claims to serve, and where the claim came from."""

    digest: str
    source: str


def expected(digest: str) -> Claim:
    """The operator's ``--expect-digest``, read by :func:`pgbase.digest_text.parse_digest`."""
    return Claim(read_digest(digest, "--expect-digest"), "--expect-digest")


def from_events_file(path: str | Path) -> Claim:
    """The digest of the weights the replica's last load put in memory.

    Weights from the daemon are its content (``daemon_digest``); a miss
    that fell back read the checkpoint from disk (``digest``); a load that
    served nothing (an error, a miss without fallback) is no claim at all.
    """
    p = Path(path)
    try:
        p.stat()  # the operator named this file: absent is an error here, not "no events"
        events = read_events(p)
    except OSError as exc:
        raise GoldenError(f"cannot read events file {p}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise GoldenError(f"cannot read events file {p}: not UTF-8 ({exc.reason})") from exc
    except UntrustedPathError as exc:  # a replica of ours could not have written it
        raise GoldenError(f"cannot trust the claim: {exc}") from exc
    if not events:
        raise GoldenError(f"events file {p} holds no load event")
    event = events[-1]
    outcome = event.get("outcome")
    if outcome == "malformed":
        raise GoldenError(f"events file {p}: last line is not a load event (not JSON, or not a JSON object): "
                          f"{str(event.get('raw'))[:60]!r}")
    # ``source`` (daemon|disk|none) says where the weights came from; older
    # events without it are read by outcome: a hit is the daemon's.
    source = event.get("source") or {"hit": "daemon", "miss": "disk"}.get(str(outcome), "none")
    field = {"daemon": "daemon_digest", "disk": "digest"}.get(str(source))
    if field is None:
        raise GoldenError(
            f"events file {p}: last load ended in {outcome!r} ({event.get('reason')}); the replica serves nothing to check"
        )
    if event.get(field) in (None, ""):
        raise GoldenError(f"events file {p}: last {outcome} event has no {field}")
    digest = read_digest(event[field], f"events file {p}: last {outcome} event's {field}")
    return Claim(digest, f"load event ({outcome}) in {p}")


def parse_metrics(text: str, source: str) -> Claim:
    """The one digest every serving rank of a daemon reports in ``/metrics``.

    ``text`` is Prometheus text exposition, read by prometheus_client's
    parser; the claim is the ``digest`` label of every ``rank_up`` sample
    whose value is 1. Raises :class:`GoldenError` when the text does not
    parse (the parser's reason in the message), when no serving rank carries
    a digest or one carries a malformed one, or when the ranks disagree.
    """
    digests = set()
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == _RANK_UP and sample.value == 1 and "digest" in sample.labels:
                    digests.add(read_digest(sample.labels["digest"], f"{source}: a serving rank's digest label"))
    except ValueError as exc:
        raise GoldenError(f"{source}: not Prometheus text exposition ({str(exc) or 'a malformed line'}); "
                          "point --metrics-url at a preload daemon's /metrics") from exc
    if not digests:
        raise GoldenError(f"{source}: no serving rank reports a digest ({_RANK_UP} == 1)")
    if len(digests) > 1:
        raise GoldenError(f"{source}: ranks report different digests: {', '.join(sorted(d[:16] for d in digests))}")
    return Claim(digests.pop(), source)


def from_metrics_url(url: str, timeout_s: float = 5.0) -> Claim:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (operator-given URL)
            text = resp.read(1 << 20).decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise GoldenError(f"cannot read daemon metrics at {url}: {exc}") from exc
    return parse_metrics(text, f"daemon metrics at {url}")
