"""A Ray cluster of several nodes on this machine, for the Ray bench row and tests.

Ray's own ``ray.cluster_utils.Cluster``: every node a raylet of its own with
its own resources, its temp files under a short private
directory (Ray's socket paths must fit ``sun_path``), and each node's
``$PRELOAD_GATE_SOCKET_ROOT`` its own (the socket-dir rule the daemon on that
node follows, passed to that raylet and so to its workers), so two daemons
on one host are as apart as on two.

>>> with LocalCluster([{"CPU": 1}, {"CPU": 1}], Path("/tmp/x")) as c:  # doctest: +SKIP
...     run_gate(opts, executor=RayExecutor(c.address))
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

OBJECT_STORE_BYTES = 100 * 1024 * 1024  # Ray's floor is 75 MiB; engines pass results, not tensors


class LocalCluster:
    """``nodes``: one dict of resources per node (``CPU``, ``GPU``, custom names);
    the first is the head. ``socket_roots`` (default: ``node<i>/sock`` under
    ``work``) gives each node its daemon socket root. Entering starts the nodes
    and connects this process (``ray.init``); leaving disconnects and stops
    them. ``node_ids``: the Ray node ids in the order given; ``add`` and
    ``remove`` change the cluster while it runs."""

    def __init__(self, nodes: Sequence[dict[str, float]], work: Path,
                 socket_roots: Sequence[str] | None = None) -> None:
        self.specs = [dict(n) for n in nodes]
        self.work = Path(work)
        self.roots = list(socket_roots or [str(self.work / f"node{i}" / "sock") for i in range(len(nodes))])
        self.node_ids: list[str] = []
        self.start_seconds = 0.0
        self._nodes: list[Any] = []
        self._tmp = ""
        self._saved_tmpdir: str | None = None

    def __enter__(self) -> LocalCluster:
        import ray
        from ray.cluster_utils import Cluster

        self._tmp = tempfile.mkdtemp(prefix="pgray-", dir="/tmp")
        self._saved_tmpdir = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = self._tmp  # where Ray writes the cluster address and sessions
        t0 = time.monotonic()
        self._cluster = Cluster(initialize_head=True, head_node_args=self._args(0, head=True))
        self._nodes = [self._cluster.head_node]
        for i in range(1, len(self.specs)):
            self._nodes.append(self._cluster.add_node(**self._args(i)))
        self._cluster.wait_for_nodes()
        ray.init(address=self._cluster.address, log_to_driver=False)
        self.start_seconds = time.monotonic() - t0
        self.node_ids = [n.node_id for n in self._nodes]
        return self

    @property
    def address(self) -> str:
        return str(self._cluster.address)

    def _args(self, i: int, head: bool = False) -> dict[str, Any]:
        spec = dict(self.specs[i])
        os.makedirs(self.roots[i], mode=0o700, exist_ok=True)
        args: dict[str, Any] = {"num_cpus": spec.pop("CPU", 1), "num_gpus": spec.pop("GPU", 0), "resources": spec,
                                "object_store_memory": OBJECT_STORE_BYTES,
                                "env_vars": {"PRELOAD_GATE_SOCKET_ROOT": self.roots[i]}}
        if head:
            args["include_dashboard"] = False
        return args

    def add(self, resources: dict[str, float], socket_root: str | None = None) -> str:
        """Start one more node; returns its Ray node id."""
        self.specs.append(dict(resources))
        self.roots.append(socket_root or str(self.work / f"node{len(self.specs) - 1}" / "sock"))
        node = self._cluster.add_node(**self._args(len(self.specs) - 1))
        self._cluster.wait_for_nodes()
        self._nodes.append(node)
        self.node_ids.append(node.node_id)
        return str(node.node_id)

    def remove(self, node_id: str) -> None:
        """Stop a (non-head) node at once, as a machine that goes away: its raylet and workers killed."""
        node = self._nodes[self.node_ids.index(node_id)]
        self._cluster.remove_node(node, allow_graceful=False)

    def root_of(self, node_id: str) -> str:
        return self.roots[self.node_ids.index(node_id)]

    def __exit__(self, *exc: object) -> None:
        import ray

        try:
            ray.shutdown()
        finally:
            self._cluster.shutdown()
            if self._saved_tmpdir is None:
                os.environ.pop("RAY_TMPDIR", None)
            else:
                os.environ["RAY_TMPDIR"] = self._saved_tmpdir
            shutil.rmtree(self._tmp, ignore_errors=True)
