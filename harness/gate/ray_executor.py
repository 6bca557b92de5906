"""The gate's second executor: every engine run a Ray task, caches placed per node.

``preload-gate gate ... --ray ADDRESS`` (``--ray auto``: ``$RAY_ADDRESS``, as
``ray.init`` reads it) runs the same scheduler (:mod:`harness.gate.schedule`)
with this executor; without the flag nothing here is imported.

- Resources: an engine asks for what it runs on: ``GPU = TP x PP x DP`` where
  the cluster has GPUs, else that many CPUs (a CPU rank binds its own core),
  plus every custom resource the operator names (``--ray-resource NAME=N``).
- Caches: a cache that lives in a process (a daemon: ``CacheTarget.node_local``)
  is prepared by an actor on every alive node whose resources fit the cached
  engines' request (``NodeAffinitySchedulingStrategy(soft=False)``); each
  node's daemon uses that node's socket root (``--socket-root``, else the
  node's own ``$PRELOAD_GATE_SOCKET_ROOT``/default: the socket-dir rules). A
  cached engine runs only on a node whose daemon holds the digest (node
  affinity, ``soft=False``), never elsewhere. A cache of files (npcache,
  sharded_state) is prepared once and read by path: ``--workdir`` must then be
  a path every node reads (on one host it is).
- ``auto`` references run anywhere; their results come back through Ray's
  object store and are stored in the reference cache of the driver, keyed as
  locally.
- Admission: a job is sent to a node only when the resources this executor
  has handed out there leave room for it (the least busy of its placements
  first), so its deadline (the engine's timeout plus ``place_timeout_s``)
  counts from a node with room, never from a queue behind other engines.
- Failures are not passes: a node lost mid-run, a run past its deadline, or
  a request no alive node (with a daemon, for a cached engine) can hold make
  the job try its next placement (a node that failed it is not tried again),
  up to ``max_attempts`` runs; then the job is *not run* with every attempt's
  reason, and its case is NOT_RUN, never judged.
- Ray itself must reach the same code: preload-gate (with vLLM) installed on
  every node; the candidates, the run's workdir and the manifest cache
  (``$PRELOAD_GATE_CACHE``) on paths every node reads (on one host they are).
  Ray's own transport carries the specs (plain JSON-able dicts): the cluster
  is the operator's, trusted as they trust it.

Each outcome carries the node that ran the engine and every attempt
(``CaseResult.placement`` in the report).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.engine import EngineResult, EngineSpec
from harness.gate.options import GateSetupError
from harness.gate.schedule import EngineJob, Outcome, plain_error, run_seen
from harness.mutations import EngineSettings
from harness.targets.base import CacheTarget, PrepareContext, PreparedCache
from pgbase import atomic

EXTRA = "pip install 'preload-gate[ray]'"
LOG_BYTES = 1 << 20  # the end of an engine's log that comes back to the report's workdir
REACH_TIMEOUT_S = 5.0  # a head that takes longer to accept a TCP connection is treated as unreachable
FORMS = "HOST:PORT (the GCS, default port 6379), ray://HOST:PORT (Ray Client, default 10001), auto or local"


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise GateSetupError(f"--ray needs the ray package ({exc}); install it: {EXTRA}") from None
    return ray


def ray_endpoint(address: str, flag: str = "--ray") -> tuple[str, int] | None:
    """Where ``ray.init(address=address)`` connects: ``(host, port)``, or None
    for ``local`` (Ray starts a cluster in this process). GateSetupError names
    a malformed address, before anything starts.

    The reading is Ray's own: an address with ``://`` goes to Ray Client
    (``ray.client``: only its ``ray`` scheme is a cluster), any other to
    ``canonicalize_bootstrap_address``, which ``ray.init`` calls and which
    turns ``localhost`` into the node's address (so the probe below knocks
    where Ray would). Ray leaves the port unchecked (``h:abc`` reaches the
    GCS client and retries there): a port that is no number from 1 to 65535
    is refused here.

    >>> ray_endpoint("ray://head:10001")  # doctest: +SKIP
    ('head', 10001)
    """
    from ray._common.network_utils import parse_address
    from ray._private.services import canonicalize_bootstrap_address
    from ray._private.utils import split_address

    def bad(why: str) -> GateSetupError:
        return GateSetupError(f"{flag} {address!r} {why}; give {FORMS}")

    client = "://" in address
    if client:
        scheme, inner = split_address(address)
        if scheme != "ray":
            raise bad(f"has scheme {scheme}://, which names no Ray cluster (http(s) is the dashboard's)")
    elif address == "local":  # ray.init starts a cluster in this process: nothing to reach
        return None
    else:
        inner = address
    parsed = parse_address(inner)
    if parsed is None:
        raise bad("is not an address")
    host, port = parsed
    if not host:
        raise bad("names no host")
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        raise bad(f"has port {port!r}, not a number from 1 to 65535")
    if not client:  # localhost -> the node's address, as ray.init connects
        host = parse_address(canonicalize_bootstrap_address(address))[0]
    return host, int(port)


def check_reachable(label: str, endpoint: tuple[str, int], timeout_s: float = REACH_TIMEOUT_S) -> None:
    """A TCP connection to where Ray would connect, before ``ray.init``: Ray
    retries an unreachable GCS for minutes; this refuses in ``timeout_s``.
    Only the TCP handshake is made (closed at once), nothing of Ray's protocol."""
    host, port = endpoint
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        why = f"no answer in {timeout_s:.0f} s" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise GateSetupError(
            f"{label}: cannot reach a Ray cluster at {host}:{port} ({why}); on the head node run "
            f"`ray status` and check the port (ray start --head --port, default 6379; ray://HOST:10001 "
            "for Ray Client), or use --ray auto with RAY_ADDRESS set") from None


def parse_resources(items: Sequence[str]) -> dict[str, float]:
    """``["accel=1", "pool_a=0.5"]`` -> ``{"accel": 1.0, "pool_a": 0.5}``; GateSetupError names a bad one."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            amount = float(value)
        except ValueError:
            amount = -1.0
        if not sep or not name or amount <= 0 or name in ("CPU", "GPU", "memory"):
            raise GateSetupError(f"--ray-resource {item!r}: give NAME=N with N > 0 and a custom name "
                                 "(CPU and GPU follow from the engine's parallelism)")
        out[name] = amount
    return out


def _engine_task(spec_json: dict[str, Any], workdir: str, timeout_s: float, worker: str) -> dict[str, Any]:
    """What runs on the node: one engine subprocess, as locally; its node id comes back."""
    import ray

    spec = EngineSpec(**{**spec_json, "prompts": tuple(spec_json["prompts"])})
    result = run_seen(spec, workdir, timeout_s, worker)  # with the digest of what this node sees
    try:
        log = (Path(workdir) / "engine.log").read_text(encoding="utf-8", errors="replace")[-LOG_BYTES:]
    except OSError:
        log = ""
    return {"result": result.to_json(), "node": ray.get_runtime_context().get_node_id(), "log": log}


class _DaemonHost:
    """A Ray actor on one node: prepares a node-local cache there and keeps it."""

    def __init__(self) -> None:
        self.cache: PreparedCache | None = None
        self.target: CacheTarget | None = None

    def prepare(self, target_name: str, target_attrs: dict[str, Any], base: str, settings: dict[str, Any],
                ctx_fields: dict[str, Any], socket_root: str | None) -> dict[str, Any]:
        import ray

        from harness.targets import get_target
        from harness.targets.digests import Digests
        from preload.sockets import default_socket_root

        target = get_target(target_name)
        for k, v in target_attrs.items():
            setattr(target, k, v)
        node = ray.get_runtime_context().get_node_id()
        root = socket_root or str(default_socket_root())
        os.makedirs(root, mode=0o700, exist_ok=True)
        digests = Digests(root)
        workdir = Path(ctx_fields.pop("workdir")) / f"node-{node[:12]}"
        workdir.mkdir(parents=True, exist_ok=True)
        ctx = PrepareContext(workdir=workdir, socket_root=root, digest_of=digests.of, promote=digests.promoted,
                             **ctx_fields)
        self.target = target
        self.cache = target.prepare(Path(base), EngineSettings(**settings), ctx)
        self.cache.node = node
        handle, self.cache.handle = self.cache.handle, None
        out = {"location": str(self.cache.location), "source_digest": self.cache.source_digest,
               "info": self.cache.info, "node": node}
        self.cache.handle = handle
        return out

    def close(self) -> None:
        if self.target is not None and self.cache is not None:
            self.target.close(self.cache)
            self.cache = None


class RayExecutor:
    """Engines as Ray tasks on a cluster (see the module docstring).

    The address's shape is checked on construction (:func:`ray_endpoint`);
    Ray is connected on first use (after the gate's own checks of its
    input), once a TCP probe found the head (:func:`check_reachable`).
    Jobs are admitted against the alive nodes' resources as this
    executor has handed them out, so a job's deadline counts from the moment
    a node has room for it, never from a queue behind other engines; a
    job's placements are tried least busy first (so a self-test's cached
    engines spread over every node whose daemon holds the digest).

    >>> ex = RayExecutor("auto", {"accel": 1})  # doctest: +SKIP
    >>> run_gate(GateOptions(candidate="/models/m", mutations="all"), executor=ex)  # doctest: +SKIP
    """

    name = "ray"
    waits_for_cached = True  # a reference whose cases' cached engines could not run is not started
    poll_s = 2.0  # how often a job waiting for room looks at the cluster again (nodes come and go)

    def __init__(self, address: str, resources: dict[str, float] | None = None, max_attempts: int = 2,
                 place_timeout_s: float = 60.0, socket_root: str | None = None) -> None:
        self.ray = import_ray()
        if address == "auto" and not os.environ.get("RAY_ADDRESS"):
            raise GateSetupError("--ray auto reads RAY_ADDRESS, which is not set; give the cluster's address "
                                 "(ray://HOST:10001 or HOST:6379)")
        # Its shape now, before the gate's first check; whether it answers, on connecting.
        if address == "auto":
            self._label = f"--ray auto (RAY_ADDRESS={os.environ['RAY_ADDRESS']})"
            self._endpoint = ray_endpoint(os.environ["RAY_ADDRESS"], "--ray auto: RAY_ADDRESS")
        else:
            self._label = f"--ray {address}"
            self._endpoint = ray_endpoint(address)
        self.address = address
        self.resources = dict(resources or {})
        self.max_attempts = max(1, max_attempts)
        self.place_timeout_s = place_timeout_s
        self.socket_root = socket_root
        self._room = threading.Condition()
        self._busy: dict[str, dict[str, float]] = {}  # node -> resources of the jobs running there
        self.used_nodes: set[str] = set()
        self._connected = False

    def _connect(self) -> None:
        with self._room:
            if self._connected:
                return
            if not self.ray.is_initialized():
                if self._endpoint is not None:
                    check_reachable(self._label, self._endpoint)
                try:
                    self.ray.init(address=self.address, log_to_driver=False)
                except Exception as exc:  # reachable, yet no cluster answered there (or it refused us)
                    raise GateSetupError(
                        f"{self._label}: Ray could not connect ({plain_error(exc)}); on the head node run `ray status` "
                        "and check this is its GCS port (default 6379) or Ray Client port (ray://HOST:10001)"
                    ) from None
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            self._affinity = NodeAffinitySchedulingStrategy
            self._task = self.ray.remote(max_retries=0)(_engine_task)
            self._host_cls = self.ray.remote(_DaemonHost)
            self._connected = True

    @property
    def slots(self) -> int:
        # Admission is ours (_admit): a waiting thread per job costs nothing.
        return 256

    # -- resources -------------------------------------------------------

    def _nodes(self) -> list[dict[str, Any]]:
        return [n for n in self.ray.nodes() if n.get("Alive")]

    def _gpus(self) -> bool:
        return any(n.get("Resources", {}).get("GPU", 0) > 0 for n in self._nodes())

    def request(self, spec: EngineSpec) -> dict[str, float]:
        """The resources one engine of ``spec`` asks for: a GPU per rank where
        the cluster has GPUs, else a CPU per rank (each rank binds a core),
        plus the operator's custom resources."""
        ranks = spec.tensor_parallel_size * spec.pipeline_parallel_size * spec.data_parallel_size
        return {("GPU" if self._gpus() else "CPU"): float(ranks), **self.resources}

    @staticmethod
    def _fits(node: dict[str, Any], want: dict[str, float], busy: dict[str, float] | None = None) -> bool:
        have, busy = node.get("Resources", {}), busy or {}
        return all(have.get(k, 0) - busy.get(k, 0) >= v - 1e-9 for k, v in want.items())

    def _options(self, want: dict[str, float], node: str) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": want.get("CPU", 0), "num_gpus": want.get("GPU", 0),
                                "scheduling_strategy": self._affinity(node, soft=False)}
        custom = {k: v for k, v in want.items() if k not in ("CPU", "GPU")}
        if custom:
            opts["resources"] = custom
        return opts

    # -- the Executor protocol --------------------------------------------

    def prepare(self, target: CacheTarget, base: Path, settings: EngineSettings,
                ctx: PrepareContext) -> list[PreparedCache]:
        if not target.node_local:
            return [target.prepare(base, settings, ctx)]
        self._connect()
        want = self.request(EngineSpec(checkpoint=str(base), tensor_parallel_size=settings.tensor_parallel_size))
        nodes = [n for n in self._nodes() if self._fits(n, want)]
        if not nodes:
            raise GateSetupError(f"no alive Ray node can run a cached engine (it needs {want}): "
                                 "the daemon was started nowhere")
        attrs = {"unsafe_identity": target.unsafe_identity, "engine_worker": target.engine_worker,
                 "reference_worker": target.reference_worker}
        fields = {"workdir": str(ctx.workdir), "engine_timeout_s": ctx.engine_timeout_s,
                  "daemon_args": ctx.daemon_args, "unsafe_identity": ctx.unsafe_identity,
                  "unsafe_silent_fallback": ctx.unsafe_silent_fallback, "env": ctx.env}
        hosts, pending = [], []
        for n in nodes:
            host = self._host_cls.options(num_cpus=0, scheduling_strategy=self._affinity(n["NodeID"], soft=False),
                                          max_restarts=0).remote()
            hosts.append(host)
            pending.append(host.prepare.remote(target.name, attrs, str(base), _settings_json(settings),
                                               dict(fields), self.socket_root))
        caches, errors = [], []
        for n, host, ref in zip(nodes, hosts, pending, strict=True):
            try:
                got = self.ray.get(ref, timeout=ctx.engine_timeout_s + self.place_timeout_s)
            except Exception as exc:  # a node whose daemon did not start holds no cache
                errors.append(f"node {n['NodeID'][:12]}: {plain_error(exc)}")
                self.ray.kill(host)
                continue
            caches.append(PreparedCache(settings, Path(got["location"]), got["source_digest"], info=got["info"],
                                        handle=host, node=got["node"]))
            ctx.note("daemon", f"daemon ready on node {got['node'][:12]} ({got['location']})")
        if not caches:
            raise GateSetupError("the cache could not be prepared on any node: " + "; ".join(errors))
        if errors:
            caches[0].info["nodes_without_daemon"] = errors
        return caches

    def close(self, target: CacheTarget, caches: Sequence[PreparedCache]) -> None:
        for cache in caches:
            if cache.node is None:
                target.close(cache)
                continue
            try:
                self.ray.get(cache.handle.close.remote(), timeout=60)
            except Exception:  # its node is gone: so is the daemon (it exits with its parent)
                pass
            self.ray.kill(cache.handle)

    def run(self, job: EngineJob) -> Outcome:
        self._connect()
        attempts: list[dict[str, Any]] = []
        lost: set[str] = set()
        while len([a for a in attempts if a.get("started")]) < self.max_attempts:
            choice = self._admit(job, lost, attempts)
            if choice is None:
                break
            node, spec, want = choice
            try:
                out = self._attempt(job, node, spec, want, attempts)
            finally:
                self._release(node, want)
            if out is not None:
                return out
            lost.add(node)
        why = "; ".join(str(a["why"]) for a in attempts if a.get("why")) or "no placement"
        return Outcome(EngineResult(ok=False, error=f"not run: {why}"), attempts=attempts,
                       not_run=f"after {sum(bool(a.get('started')) for a in attempts)} run(s): {why}")

    def _attempt(self, job: EngineJob, node: str, spec: EngineSpec, want: dict[str, float],
                 attempts: list[dict[str, Any]]) -> Outcome | None:
        """One run on ``node``: its outcome, or None (recorded in ``attempts``) when it never answered."""
        spec = dataclasses.replace(spec, env={**spec.env, **job.env})
        deadline = job.timeout_s + self.place_timeout_s
        t0 = time.monotonic()
        ref = self._task.options(**self._options(want, node)).remote(spec.to_json(), str(job.workdir),
                                                                     job.timeout_s, job.worker)
        try:
            got = self.ray.get(ref, timeout=deadline)
        except self.ray.exceptions.GetTimeoutError:
            self.ray.cancel(ref, force=True)
            why = f"node {node[:12]}: the run did not finish in {deadline:.0f} s"
        except Exception as exc:  # the node or the worker died under the engine
            why = f"node {node[:12]}: {plain_error(exc)}"
        else:
            result = EngineResult.from_json(got["result"])
            attempts.append({"node": got["node"], "placed_on": node, "started": True, "ok": result.ok,
                             "seconds": round(time.monotonic() - t0, 3)})
            _keep_log(job.workdir, got.get("log", ""))
            with self._room:
                self.used_nodes.add(got["node"])
            return Outcome(result, node=got["node"], attempts=attempts)
        attempts.append({"node": node, "placed_on": node, "started": True, "ok": False,
                         "seconds": round(time.monotonic() - t0, 3), "why": why})
        return None

    def _admit(self, job: EngineJob, lost: set[str],
               attempts: list[dict[str, Any]]) -> tuple[str, EngineSpec, dict[str, float]] | None:
        """A node with room for one of ``job``'s placements, its resources
        reserved; waits while the job fits somewhere only busy; None (the
        reasons in ``attempts``) when no alive node can ever hold it."""
        with self._room:
            while True:
                alive = {n["NodeID"]: n for n in self._nodes()}
                fits: list[tuple[str, EngineSpec, dict[str, float]]] = []
                for choice in job.choices:
                    want = self.request(choice.spec)
                    if choice.node is None:
                        where = [i for i, n in alive.items() if i not in lost and self._fits(n, want)]
                        if not where:
                            _once(attempts, f"cannot be placed: no alive node has {want}")
                        fits += [(i, choice.spec, want) for i in where]
                        continue
                    if choice.node in lost:
                        continue
                    if choice.node not in alive:
                        lost.add(choice.node)
                        _once(attempts, f"node {choice.node[:12]} (its daemon holds the digest) is gone")
                    elif not self._fits(alive[choice.node], want):
                        lost.add(choice.node)
                        _once(attempts, f"cannot be placed next to its daemon: node {choice.node[:12]} has "
                                        f"{_have(alive[choice.node], want)}, the engine needs {want}")
                    else:
                        fits.append((choice.node, choice.spec, want))
                if not fits:
                    return None
                free = [f for f in fits if self._fits(alive[f[0]], f[2], self._busy.get(f[0]))]
                if free:
                    node, spec, want = min(free, key=lambda f: sum(self._busy.get(f[0], {}).values()))
                    busy = self._busy.setdefault(node, {})
                    for k, v in want.items():
                        busy[k] = busy.get(k, 0.0) + v
                    return node, spec, want
                self._room.wait(self.poll_s)

    def _release(self, node: str, want: dict[str, float]) -> None:
        with self._room:
            busy = self._busy.get(node, {})
            for k, v in want.items():
                busy[k] = busy.get(k, 0.0) - v
            self._room.notify_all()

    def describe(self) -> dict[str, Any]:
        self._connect()
        nodes = [{"node": n["NodeID"], "address": n.get("NodeManagerAddress"),
                  "resources": {k: v for k, v in n.get("Resources", {}).items() if not k.startswith("node:")}}
                 for n in self._nodes()]
        return {"kind": "ray", "address": self.address, "resources": self.resources,
                "max_attempts": self.max_attempts, "nodes": nodes}


def _once(attempts: list[dict[str, Any]], why: str) -> None:
    if not any(a.get("why") == why for a in attempts):
        attempts.append({"node": None, "started": False, "ok": False, "why": why})


def _keep_log(workdir: Path, text: str) -> None:
    """The engine's log where the judge reads it (the node's own copy is on
    the node: on one host, the same file)."""
    path = Path(workdir) / "engine.log"
    try:
        if path.read_text(encoding="utf-8", errors="replace") == text:
            return
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, text)


def _have(node: dict[str, Any], want: dict[str, float]) -> dict[str, float]:
    return {k: node.get("Resources", {}).get(k, 0) for k in want}


def _settings_json(s: EngineSettings) -> dict[str, Any]:
    return {"dtype": s.dtype, "tensor_parallel_size": s.tensor_parallel_size,
            "data_parallel_size": s.data_parallel_size}
