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
- Failures are not passes: a node lost mid-run, a task past its deadline
  (the engine's timeout plus ``place_timeout_s``) or a request no alive node
  (with a daemon, for a cached engine) can hold make the job try its next
  placement, up to ``max_attempts``; then the job is *not run* with every
  attempt's reason, and its case is NOT_RUN, never judged.

Each outcome carries the node that ran the engine and every attempt
(``CaseResult.placement`` in the report).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.engine import EngineResult, EngineSpec, run_engine
from harness.gate.options import GateSetupError
from harness.gate.schedule import EngineJob, Outcome
from harness.mutations import EngineSettings
from harness.targets.base import CacheTarget, PrepareContext, PreparedCache

EXTRA = "pip install 'preload-gate[ray]'"


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise GateSetupError(f"--ray needs the ray package ({exc}); install it: {EXTRA}") from None
    return ray


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
    result = run_engine(spec, workdir, timeout_s=timeout_s, worker=worker)
    return {"result": result.to_json(), "node": ray.get_runtime_context().get_node_id()}


class _DaemonHost:
    """A Ray actor on one node: prepares a node-local cache there and keeps it."""

    def __init__(self) -> None:
        self.cache: PreparedCache | None = None
        self.target: CacheTarget | None = None

    def prepare(self, target_name: str, target_attrs: dict[str, Any], base: str, settings: dict[str, Any],
                ctx_fields: dict[str, Any], socket_root: str | None) -> dict[str, Any]:
        import ray

        from harness.gate.digests import Digests
        from harness.targets import get_target
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

    >>> ex = RayExecutor("auto", {"accel": 1})  # doctest: +SKIP
    >>> run_gate(GateOptions(candidate="/models/m", mutations="all"), executor=ex)  # doctest: +SKIP
    """

    name = "ray"
    waits_for_cached = True  # a reference whose cases' cached engines could not run is not started

    def __init__(self, address: str, resources: dict[str, float] | None = None, max_attempts: int = 2,
                 place_timeout_s: float = 60.0, socket_root: str | None = None) -> None:
        self.ray = import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._affinity = NodeAffinitySchedulingStrategy
        if address == "auto" and not os.environ.get("RAY_ADDRESS"):
            raise GateSetupError("--ray auto reads RAY_ADDRESS, which is not set; give the cluster's address "
                                 "(ray://HOST:10001 or HOST:6379)")
        self.address = address
        if not self.ray.is_initialized():
            self.ray.init(address=address, log_to_driver=False, include_dashboard=False)
        self.resources = dict(resources or {})
        self.max_attempts = max(1, max_attempts)
        self.place_timeout_s = place_timeout_s
        self.socket_root = socket_root
        self._hosts: dict[int, list[Any]] = {}
        self._lock = threading.Lock()
        self.used_nodes: set[str] = set()
        self._task = self.ray.remote(max_retries=0)(_engine_task)
        self._host_cls = self.ray.remote(_DaemonHost)

    @property
    def slots(self) -> int:
        # Ray queues what does not fit: one waiting thread per job is free.
        return 256

    # -- placement -------------------------------------------------------

    def _nodes(self) -> list[dict[str, Any]]:
        return [n for n in self.ray.nodes() if n.get("Alive")]

    def _gpus(self) -> bool:
        return any(n.get("Resources", {}).get("GPU", 0) > 0 for n in self._nodes())

    def request(self, spec: EngineSpec) -> dict[str, float]:
        """The resources one engine of ``spec`` asks for."""
        ranks = spec.tensor_parallel_size * spec.pipeline_parallel_size * spec.data_parallel_size
        want = {("GPU" if self._gpus() else "CPU"): float(ranks), **self.resources}
        return want

    @staticmethod
    def _fits(node: dict[str, Any], want: dict[str, float]) -> bool:
        have = node.get("Resources", {})
        return all(have.get(k, 0) >= v for k, v in want.items())

    def _options(self, want: dict[str, float]) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": want.get("CPU", 0), "num_gpus": want.get("GPU", 0)}
        custom = {k: v for k, v in want.items() if k not in ("CPU", "GPU")}
        if custom:
            opts["resources"] = custom
        return opts

    # -- the Executor protocol --------------------------------------------

    def prepare(self, target: CacheTarget, base: Path, settings: EngineSettings,
                ctx: PrepareContext) -> list[PreparedCache]:
        if not target.node_local:
            return [target.prepare(base, settings, ctx)]
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
                errors.append(f"node {n['NodeID'][:12]}: {_why(exc)}")
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
        attempts: list[dict[str, Any]] = []
        lost: set[str] = set()
        for _ in range(self.max_attempts):
            choice = self._next(job, lost, attempts)
            if choice is None:
                break
            node, spec, want = choice
            spec = dataclasses.replace(spec, env={**spec.env, **job.env})
            opts = self._options(want)
            if node is not None:
                opts["scheduling_strategy"] = self._affinity(node, soft=False)
            t0 = time.monotonic()
            ref = self._task.options(**opts).remote(spec.to_json(), str(job.workdir), job.timeout_s, job.worker)
            try:
                got = self.ray.get(ref, timeout=job.timeout_s + self.place_timeout_s)
            except self.ray.exceptions.GetTimeoutError:
                self.ray.cancel(ref, force=True)
                attempts.append({"node": node, "ok": False, "seconds": round(time.monotonic() - t0, 3),
                                 "why": f"the task did not finish in {job.timeout_s + self.place_timeout_s:.0f} s"})
                if node:
                    lost.add(node)
                continue
            except Exception as exc:  # the node or the worker died under the engine
                attempts.append({"node": node, "ok": False, "seconds": round(time.monotonic() - t0, 3),
                                 "why": _why(exc)})
                if node:
                    lost.add(node)
                continue
            result = EngineResult.from_json(got["result"])
            attempts.append({"node": got["node"], "ok": result.ok, "seconds": round(time.monotonic() - t0, 3)})
            with self._lock:
                self.used_nodes.add(got["node"])
            return Outcome(result, node=got["node"], attempts=attempts)
        why = "; ".join(str(a["why"]) for a in attempts if a.get("why")) or "no placement"
        return Outcome(EngineResult(ok=False, error=f"not run: {why}"), attempts=attempts,
                       not_run=f"after {len(attempts)} attempt(s): {why}")

    def _next(self, job: EngineJob, lost: set[str],
              attempts: list[dict[str, Any]]) -> tuple[str | None, EngineSpec, dict[str, float]] | None:
        """The next placement that an alive node can hold; records why others cannot."""
        alive = {n["NodeID"]: n for n in self._nodes()}
        for choice in job.choices:
            want = self.request(choice.spec)
            if choice.node is None:
                if any(self._fits(n, want) for n in alive.values()):
                    return None, choice.spec, want
                attempts.append({"node": None, "ok": False,
                                 "why": f"cannot be placed: no alive node has {want}"})
                return None
            if choice.node in lost:
                continue
            if choice.node not in alive:
                lost.add(choice.node)
                attempts.append({"node": choice.node, "ok": False,
                                 "why": f"node {choice.node[:12]} (its daemon holds the digest) is gone"})
                continue
            if not self._fits(alive[choice.node], want):
                lost.add(choice.node)
                attempts.append({"node": choice.node, "ok": False,
                                 "why": f"cannot be placed next to its daemon: node {choice.node[:12]} has "
                                        f"{_have(alive[choice.node], want)}, the engine needs {want}"})
                continue
            return choice.node, choice.spec, want
        return None

    def describe(self) -> dict[str, Any]:
        nodes = [{"node": n["NodeID"], "address": n.get("NodeManagerAddress"),
                  "resources": {k: v for k, v in n.get("Resources", {}).items() if not k.startswith("node:")}}
                 for n in self._nodes()]
        return {"kind": "ray", "address": self.address, "resources": self.resources,
                "max_attempts": self.max_attempts, "nodes": nodes}


def _have(node: dict[str, Any], want: dict[str, float]) -> dict[str, float]:
    return {k: node.get("Resources", {}).get(k, 0) for k in want}


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _settings_json(s: EngineSettings) -> dict[str, Any]:
    return {"dtype": s.dtype, "tensor_parallel_size": s.tensor_parallel_size,
            "data_parallel_size": s.data_parallel_size}
