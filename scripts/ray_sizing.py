"""Wall time of ``gate --mutations all`` on N Ray nodes, from measured per-engine times.

    python scripts/ray_sizing.py BENCH.json [--nodes 1,4,14]
    python scripts/ray_sizing.py --cached-s 40 --reference-s 45 --daemon-s 60 [--nodes 1,4,14]

BENCH.json: what ``preload-gate bench gate_ray --json`` printed: the medians
of its ``local`` run's per-engine wall seconds and its daemon start (each
engine alone on the machine, as an engine that has its node to itself;
``--run ray`` takes the cluster run's, two engines sharing two cores). For a model that needs one node per engine (a 70B at
TP=8 on 8-GPU nodes) every engine takes a whole node, so a node runs one
engine at a time; the simulation follows the gate's Ray executor
(harness/gate/ray_executor.py): a daemon starts on every node at once, the
cases' cached engines are admitted first, least busy node first, and each
``auto`` reference once its case's cached engine has run; an engine starts
on the first node that is free. Every case of the catalogue is counted
(``tp_shift`` included: it runs on GPUs) with its own cached engine and its
own reference, none reused from the reference cache (a cold run: a rerun
starts only the cached engines, ``--reference-cache``).

Prints a Markdown table: nodes, wall seconds, speed-up over one node.
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cases() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from harness.gate import select_target_cases
    from harness.targets import get_target

    return [c.name for c in select_target_cases(get_target("verified_cache"), "all")]


def wall(nodes: int, n_cases: int, cached_s: float, reference_s: float, daemon_s: float) -> float:
    """Makespan of ``n_cases`` cached engines then their references on ``nodes`` nodes, one engine a node."""
    free = [daemon_s] * nodes  # when each node is next free (its daemon first)
    heapq.heapify(free)
    cached_done = []
    for _ in range(n_cases):
        start = heapq.heappop(free)
        cached_done.append(start + cached_s)
        heapq.heappush(free, start + cached_s)
    end = max(cached_done, default=daemon_s)
    for done in cached_done:  # a reference waits for its case's cached engine
        start = max(heapq.heappop(free), done)
        heapq.heappush(free, start + reference_s)
        end = max(end, start + reference_s)
    return end


def measured(bench: Path, which: str = "local") -> tuple[float, float, float]:
    rows = json.loads(bench.read_text())
    rows = rows.get("results", rows) if isinstance(rows, dict) else rows
    (row,) = [r for r in rows if r.get("row") == "gate_ray"]
    run = row["details"]["runs"][which]
    by = {k: [e["seconds"] for e in run["engines"] if e["kind"] == k] for k in ("cached", "reference")}
    return statistics.median(by["cached"]), statistics.median(by["reference"]), float(run["daemon_start_seconds"])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("bench", nargs="?", type=Path)
    p.add_argument("--cached-s", type=float)
    p.add_argument("--reference-s", type=float)
    p.add_argument("--daemon-s", type=float)
    p.add_argument("--nodes", default="1,4,14")
    p.add_argument("--run", choices=("local", "ray"), default="local", help="which run of BENCH.json")
    a = p.parse_args(argv)
    if a.bench is not None:
        cached_s, reference_s, daemon_s = measured(a.bench, a.run)
    elif None not in (a.cached_s, a.reference_s, a.daemon_s):
        cached_s, reference_s, daemon_s = a.cached_s, a.reference_s, a.daemon_s
    else:
        p.error("give BENCH.json, or all of --cached-s, --reference-s and --daemon-s")
    n = len(cases())
    one = wall(1, n, cached_s, reference_s, daemon_s)
    print(f"{n} cases; per engine: cached {cached_s:.1f} s, reference {reference_s:.1f} s; "
          f"daemon start {daemon_s:.1f} s\n")
    print("| nodes | wall (s) | wall (min) | speed-up |\n|---|---|---|---|")
    for nodes in (int(x) for x in a.nodes.split(",")):
        w = wall(nodes, n, cached_s, reference_s, daemon_s)
        print(f"| {nodes} | {w:.0f} | {w / 60:.1f} | {one / w:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
