"""Rank placement, pinned against a table of vLLM's rule."""

from __future__ import annotations

import pytest

from preload.daemon.placement import Parallelism, PlacementError, plan_local_ranks

pytestmark = pytest.mark.unit

# (parallelism, [(local, global, dp, pp, tp), ...])
TABLE = [
    (Parallelism(), [(0, 0, 0, 0, 0)]),
    (Parallelism(tp_size=2), [(0, 0, 0, 0, 0), (1, 1, 0, 0, 1)]),
    (Parallelism(tp_size=2, pp_size=2),
     [(0, 0, 0, 0, 0), (1, 1, 0, 0, 1), (2, 2, 0, 1, 0), (3, 3, 0, 1, 1)]),
    (Parallelism(tp_size=4, nnodes=2, node_rank=1), [(0, 2, 0, 0, 2), (1, 3, 0, 0, 3)]),
    (Parallelism(tp_size=1, dp_size=4, dp_size_local=2, dp_start_rank=2),
     [(0, 2, 2, 0, 0), (1, 3, 3, 0, 0)]),
    (Parallelism(tp_size=2, dp_size=2),
     [(0, 0, 0, 0, 0), (1, 1, 0, 0, 1), (2, 2, 1, 0, 0), (3, 3, 1, 0, 1)]),
    # TP8 x DP2 on 4 nodes: node 3 serves global ranks 12..15 = dp 1, tp 4..7.
    (Parallelism(tp_size=8, dp_size=2, nnodes=4, node_rank=3),
     [(i, 12 + i, 1, 0, 4 + i) for i in range(4)]),
    (Parallelism(tp_size=2, pp_size=2, nnodes=2, node_rank=1), [(0, 2, 0, 1, 0), (1, 3, 0, 1, 1)]),
]


@pytest.mark.parametrize("par, want", TABLE)
def test_placement_table(par, want):
    got = [(p.local_rank, p.global_rank, p.dp_rank, p.pp_rank, p.tp_rank) for p in plan_local_ranks(par)]
    assert got == want


def test_global_rank_formula_holds_everywhere():
    for tp in (1, 2, 4):
        for pp in (1, 2):
            for dp in (1, 2, 3):
                for p in plan_local_ranks(Parallelism(tp_size=tp, pp_size=pp, dp_size=dp)):
                    assert p.global_rank == p.dp_rank * pp * tp + p.pp_rank * tp + p.tp_rank


@pytest.mark.parametrize("par, match", [
    (Parallelism(tp_size=3, nnodes=2), "evenly divide"),
    (Parallelism(dp_size=2, dp_size_local=2, dp_start_rank=1), "exceeds"),
    (Parallelism(tp_size=0), "tp_size must be at least 1"),
    (Parallelism(nnodes=2, node_rank=2), "node rank 2"),
])
def test_impossible_placements_are_refused(par, match):
    with pytest.raises(PlacementError, match=match):
        plan_local_ranks(par)


def test_dry_run_prints_the_plan_and_loads_nothing(tmp_path):
    import json
    import subprocess
    import sys

    from fixtures.tiny import write_tiny

    ckpt = write_tiny(tmp_path / "ckpt")
    out = subprocess.run(
        # (tp 2: the tiny model's 2 heads refuse tp 4, as vLLM would)
        [sys.executable, "-m", "preload_gate.cli", "preload", str(ckpt), "-tp", "2", "-dp", "2", "--nnodes", "2",
         "--node-rank", "1", "--identity", "full", "--socket-root", str(tmp_path / "s"), "--dry-run", "--json"],
        capture_output=True, text=True, check=True, env={"PRELOAD_GATE_CACHE": str(tmp_path / "c"), "PATH": ""},
    )
    plan = json.loads(out.stdout)
    assert [(r["global_rank"], r["dp_rank"], r["tp_rank"]) for r in plan["ranks"]] == [(2, 1, 0), (3, 1, 1)]
    assert plan["stage"] == "loaded" and plan["transport"] == "shm" and plan["expected_digest"] is None
    assert not (tmp_path / "s").exists()  # nothing created


def test_every_rank_gets_the_verbs_daemon_settings_as_they_are():
    """The launcher's orders to each rank carry every daemon setting of the
    ``preload`` verb unchanged (the engine's with the sizes added), beside the
    rank's own place; a setting added to DaemonSettings needs a row here."""
    from dataclasses import fields

    from preload.daemon.launcher import PreloadOptions, rank_orders
    from preload.daemon.settings import DaemonSettings

    settings = {"checkpoint": "/models/m", "stage": "raw", "transport": "cuda", "socket_root": "/run/pg",
                "unsafe_identity": "header_only", "engine": {"dtype": "float16"}, "fd_store": False,
                "take_over": True, "orphan_ttl_s": 120.0}
    assert set(settings) == {f.name for f in fields(DaemonSettings)}
    opts = PreloadOptions(**settings, parallel=Parallelism(tp_size=2), identity="pinned",
                          expect_digest="AB" * 32, master_port=29500)
    orders = rank_orders(opts)
    assert [(p.global_rank, cfg.global_rank, cfg.tp_rank) for p, cfg in orders] == [(0, 0, 0), (1, 1, 1)]
    for _, cfg in orders:
        assert {k: getattr(cfg, k) for k in settings} == {**settings, "engine": {
            "dtype": "float16", "tp_size": 2, "pp_size": 1, "dp_size": 1}}
        assert cfg.expected_digest == "ab" * 32
        assert cfg.distributed_init_method == "tcp://127.0.0.1:29500"
        assert cfg.cpus is None  # the raw stage binds no cores
