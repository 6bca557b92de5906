"""The ``verified_cache`` loader class: vLLM's side of an attach.

vLLM is imported here; :mod:`preload.loader` (steps, extra config) imports
this module only when vLLM asks for the class, so ``import preload`` works
without vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.model_executor.utils import weights_already_processed
from vllm.utils.torch_utils import set_default_torch_dtype

from pgbase.errors import (
    CacheKeyMismatchError,
    PreloadGateError,
    ProtocolError,
    WeightCacheUnavailableError,
)
from pgbase.oscause import reason
from preload.events import LoadEvent, emit
from preload.loader import misses, resident
from preload.loader.memory import daemon_device_bytes
from preload.loader.misses import Miss
from preload.loader.options import LOAD_FORMAT, LoaderConfigError, LoaderOptions
from preload.loader.ranks import global_rank_of, rank_info

log = logging.getLogger("preload.loader")  # the plugin's name, not this submodule's

# Daemon losses seen by this process (zero-copy watch connections that closed).
DAEMON_LOSSES = 0


def _forget_exception_frames(exc: BaseException) -> None:
    """Drop the locals of the frames an exception holds (tensors over a
    mapped arena, the half-built model), so a failed attach unmaps now, not
    when the traceback happens to be collected."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__
    gc.collect()


def _attach_failure_kind(miss: Miss) -> str:
    """The daemon's name for why an attach after its ok answer failed
    (:data:`preload.protocol.ATTACH_FAILURE_KINDS`)."""
    from preload.checksum.resident import ResidentWeightsChangedError

    if miss.fields == ["content_digest"]:
        return "digest"
    return "verify" if isinstance(miss.cause, ResidentWeightsChangedError) else "attach"


@contextlib.contextmanager
def _phase(event: LoadEvent, name: str) -> Iterator[None]:
    """Time one step of a load into ``event.phases[name]`` (seconds), however it ends."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        event.phases[name] = round(time.perf_counter() - t0, 6)


def _on_daemon_loss(sdir: str, rank: int) -> None:
    global DAEMON_LOSSES
    DAEMON_LOSSES += 1
    log.warning(
        "preload-gate: the weight daemon for rank %d (%s) went away; this engine keeps its mapped "
        "weights (zero-copy), but a restart will miss until a daemon serves again (losses: %d)",
        rank, sdir, DAEMON_LOSSES,
    )


class VerifiedCacheLoader(BaseModelLoader):
    """Maps a daemon's content-proven weights; the steps are in :mod:`preload.loader`."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        extra = load_config.model_loader_extra_config
        # A bad extra config fails the start in load_model, where it
        # still gets its one event (the constructor has no rank yet).
        self.config_error: LoaderConfigError | None = None
        try:
            self.opts = LoaderOptions.from_extra(extra)
        except LoaderConfigError as exc:
            self.config_error = exc
            events_file = extra.get("events_file") if isinstance(extra, dict) else None
            self.opts = LoaderOptions(events_file=events_file if isinstance(events_file, str) else None)
        self._watch: Any = None
        self._attachment: Any = None

    def _disk_config(self) -> Any:
        return dataclasses.replace(self.load_config, load_format="auto", model_loader_extra_config={})

    def download_model(self, model_config: Any) -> None:
        DefaultModelLoader(self._disk_config()).download_model(model_config)

    def load_weights(self, model: Any, model_config: Any) -> None:
        # In-place reloads (weight updates) come from disk, never the cache.
        DefaultModelLoader(self._disk_config()).load_weights(model, model_config)

    def get_external_weight_memory(self, vllm_config: Any) -> int:
        """Device bytes this engine will map from a daemon instead of
        allocating: the arena's, in zero_copy mode on a GPU, when a daemon
        answers for this engine's content digest; else 0.

        vLLM's GPU worker asks every loader this before its start-up memory
        check and takes the bytes off the engine's budget
        (``request_memory``, vllm/v1/worker/utils.py; asked in
        gpu_worker.py ``init_device``), as it does for its own
        ``IpcModelLoader.get_external_weight_memory``. So the daemon's bytes
        are counted once: an engine beside it starts at the
        ``gpu_memory_utilization`` an ``auto`` engine starts at and gets the
        KV cache ``auto`` gets. On CPU the arena is shared file memory, not
        device memory (0). A daemon that cannot be asked, or serves other
        content, means a disk load: 0, as vLLM's own loader answers; the
        load's event then says why.
        """
        if self.config_error is not None:
            return 0
        return daemon_device_bytes(self.opts, vllm_config)

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
        """One event on every path: hit, a loud miss then disk, or a named
        start-up failure; whatever is raised, even BaseException."""
        start = time.perf_counter()
        opts = self.opts
        event = LoadEvent(outcome="error", reason="the load did not finish", mode=opts.mode)
        emitted = False

        def finish() -> None:
            nonlocal emitted
            emitted = True
            event.seconds = time.perf_counter() - start
            emit(event, opts.events_file)  # never raises

        try:
            cause: BaseException | None = None
            try:
                if self.config_error is not None:
                    event.reason = str(self.config_error)
                    finish()
                    raise self.config_error
                ranks = rank_info()
                global_rank, event.dp_rank = global_rank_of(vllm_config, ranks)
                event.rank = global_rank
                model = self._load_cached(vllm_config, model_config, prefix, ranks, global_rank, event)
            except Miss as miss:
                event.outcome, event.reason, event.fields = miss.outcome, miss.reason, miss.fields
                event.daemon_digest = miss.daemon_digest or event.daemon_digest
                cause = miss.cause
            except Exception as exc:
                if emitted:
                    raise
                # Outside the expected set (a read-only manifest cache, an
                # unreadable config.json, a bug): still one loud event.
                # A named failure of ours is its one line; anything else
                # (a bug, a library error) keeps its traceback for a report.
                log.warning("preload-gate: the cache could not be used: %s: %s", type(exc).__name__, exc,
                            exc_info=not isinstance(exc, PreloadGateError))
                event.outcome, event.reason = "error", (f"{type(exc).__name__}: {exc}"
                                                        if isinstance(exc, PreloadGateError) else reason(exc))
                cause = exc
            else:
                event.outcome, event.reason, event.source = "hit", "daemon served the key", "daemon"
                finish()
                return model
            if cause is not None:
                _forget_exception_frames(cause)
            if not opts.fallback:
                finish()
                if isinstance(cause, CacheKeyMismatchError):
                    raise CacheKeyMismatchError(
                        event.fields, f"{LOAD_FORMAT} with fallback off: {event.reason}") from cause
                err_type = type(cause) if isinstance(cause, PreloadGateError) and not isinstance(
                    cause, OSError) else WeightCacheUnavailableError
                raise err_type(f"{LOAD_FORMAT} with fallback off: {event.reason}") from cause
            if opts.unsafe_silent_fallback:
                # UNSAFE control (test-only switch): what a quiet cache does. No event.
                emitted = True
                log.warning("falling back to disk (%s)", event.reason)
                return DefaultModelLoader(self._disk_config()).load_model(vllm_config, model_config, prefix)
            try:
                model = DefaultModelLoader(self._disk_config()).load_model(vllm_config, model_config, prefix)
            except BaseException as exc:
                event.outcome, event.source = "error", "none"
                event.reason = f"{event.reason}; the disk fallback failed too: {type(exc).__name__}: {exc}"
                finish()
                raise
            event.source = "disk"
            finish()
            return model
        except BaseException as exc:
            if not emitted:  # KeyboardInterrupt, SystemExit, a bug in the paths above
                event.outcome, event.source = "error", "none"
                event.reason = f"the load was interrupted: {type(exc).__name__}: {exc}"
                finish()
            raise

    def _load_cached(self, vllm_config: Any, model_config: Any, prefix: str, ranks: dict[str, int],
                     global_rank: int, event: LoadEvent) -> Any:
        from preload.client import DaemonClient, Watch
        from preload.sockets import socket_dir, socket_path
        from preload.vllm_key import export_stage_for, key_from_vllm, transport_for

        opts = self.opts
        device_type = str(vllm_config.device_config.device_type or "cpu")
        with _phase(event, "resolve"):
            digest = misses.resolve(opts, model_config.model, event)
        event.digest = digest
        sdir = Path(opts.socket_dir) if opts.socket_dir else socket_dir(digest, opts.socket_root)
        event.socket_dir = str(sdir)
        stage = export_stage_for(device_type)
        key = key_from_vllm(
            vllm_config, digest, **ranks,
            dp_size=int(vllm_config.parallel_config.data_parallel_size),
            dp_rank=int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0),
            export_stage=stage, transport=transport_for(device_type),
        )
        from preload.preflight import socket_path_problem

        problem = socket_path_problem(socket_path(sdir, global_rank))
        if problem:  # known before any connect: say which path and what to do
            raise misses.socket_path(problem)
        if not socket_path(sdir, global_rank).exists():
            other = self._other_rank_mismatch(sdir, global_rank, key, model_config.model)
            if other is not None:
                raise other
            raise misses.no_socket(opts, sdir, global_rank, digest, model_config.model)
        try:
            with _phase(event, "connect"):
                client = DaemonClient.connect(sdir, global_rank, opts.connect_timeout_s, opts.state_timeout_s,
                                              client=f"vllm-rank{global_rank}")
        except (WeightCacheUnavailableError, ProtocolError) as exc:
            raise misses.daemon_unavailable(exc, sdir, global_rank, model_config.model) from exc
        try:
            event.daemon_digest = client.hello.get("digest")
            pid = client.hello.get("pid")
            try:
                with _phase(event, "state"):
                    state = client.get_state(key)
            except CacheKeyMismatchError as exc:
                raise misses.key_mismatch(exc, key, model_config.model, sdir, pid, global_rank) from exc
            except (WeightCacheUnavailableError, ProtocolError) as exc:
                raise misses.bad_answer(exc, sdir, pid, global_rank, model_config.model) from exc
            event.daemon_digest = state.digest
            try:
                if state.digest != digest:
                    raise misses.wrong_digest(sdir, state.digest, digest, pid, global_rank, model_config.model)
                try:
                    model = self._build(vllm_config, model_config, prefix, state, event)
                except PreloadGateError as exc:
                    raise misses.attach_failed(exc) from exc
                except Exception as exc:
                    log.exception("attaching the daemon's weights failed")
                    raise misses.attach_failed(exc) from exc
            except Miss as miss:
                client.report_attach(False, _attach_failure_kind(miss), miss.reason)  # never raises
                raise
            finally:
                state.close()  # descriptors not yet handed to attach (a no-op after it)
            client.report_attach()  # the daemon counts the hit now, not when its reply left
            event.tensors, event.bytes = len(state.layout.entries), state.layout.total_bytes
            if opts.mode == "copy":
                try:
                    client.release()
                except (PreloadGateError, OSError) as exc:
                    # The engine holds its own copy: the hit stands; the
                    # daemon merely keeps its memory until it is stopped.
                    log.warning("preload-gate: copy mode: the daemon in %s did not release its arena "
                                "(%s); this engine is unaffected, the daemon still holds %d bytes",
                                sdir, exc, state.layout.total_bytes)
            else:
                try:
                    self._watch = Watch.open(sdir, global_rank, lambda: _on_daemon_loss(str(sdir), global_rank))
                except (WeightCacheUnavailableError, ProtocolError, OSError) as exc:
                    # The weights are already mapped (and stay mapped after the
                    # daemon exits), so the hit stands; losing the daemon in
                    # this window is a daemon loss, not a failed load.
                    log.warning("preload-gate: cannot watch the daemon in %s: %s", sdir, exc)
                    _on_daemon_loss(str(sdir), global_rank)
            return model
        finally:
            client.close()

    def _other_rank_mismatch(self, sdir: Path, global_rank: int, key: Any, checkpoint: str) -> Miss | None:
        """Daemons serve this digest but not this rank (say TP=2 against a
        TP=1 daemon): ask one of them which key fields differ, so the miss
        names the layout, not the content."""
        from preload.client import DaemonClient

        ranks = sorted(int(p.stem.removeprefix("rank")) for p in sdir.glob("rank*.sock")
                       if p.stem.removeprefix("rank").isdigit())
        if not ranks:
            return None
        try:
            client = DaemonClient.connect(sdir, ranks[0], self.opts.connect_timeout_s,
                                          self.opts.state_timeout_s, client=f"vllm-rank{global_rank}")
        except (WeightCacheUnavailableError, ProtocolError):
            return None
        try:
            client.get_state(key).close()
        except CacheKeyMismatchError as exc:
            return misses.key_mismatch(exc, key, checkpoint, sdir, client.hello.get("pid"), global_rank, ranks)
        except (WeightCacheUnavailableError, ProtocolError):
            return None
        finally:
            client.close()
        return None

    def _build(self, vllm_config: Any, model_config: Any, prefix: str, state: Any, event: LoadEvent) -> Any:
        device = torch.device(vllm_config.device_config.device or "cpu")
        forward_ctx = vllm_config.compilation_config.static_forward_context
        saved_ctx = dict(forward_ctx)
        self._undo: list[tuple[Any, str, Any, Any, bool, bool]] = []
        try:
            return self._build_into(vllm_config, model_config, prefix, state, device, event)
        except BaseException:
            # Undo what the failed build registered, so a disk fallback
            # can build the model again (vLLM refuses a duplicate layer
            # name), and drop the mapping's views.
            forward_ctx.clear()
            forward_ctx.update(saved_ctx)
            for module, leaf, param, buf, had_param, had_buf in reversed(self._undo):
                module._parameters.pop(leaf, None)
                module._buffers.pop(leaf, None)
                if had_param:
                    module._parameters[leaf] = param
                if had_buf:
                    module._buffers[leaf] = buf
            attachment, self._attachment = self._attachment, None
            if attachment is not None:
                attachment.close()
            raise
        finally:
            self._undo = []

    def _build_into(self, vllm_config: Any, model_config: Any, prefix: str, state: Any,
                    device: Any, event: LoadEvent) -> Any:
        with set_default_torch_dtype(model_config.dtype):
            with _phase(event, "build"), torch.device("meta"):
                model = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
            # copy mode only reads the daemon's tensors (it clones them): read-only where the transport can.
            with _phase(event, "map"):
                attachment = self._attachment = state.attach(writable=self.opts.mode != "copy")
            modules = dict(model.named_modules(remove_duplicate=False))
            registered: dict[str, torch.Tensor] = {}
            kinds = {e.name: e.kind for e in state.layout.entries}

            def register(name: str, tensor: torch.Tensor, is_param: bool) -> None:
                module_name, _, leaf = name.rpartition(".")
                module = modules.get(module_name)
                if module is None:
                    raise WeightCacheUnavailableError(f"daemon tensor {name} has no module in this model")
                old = module._parameters.get(leaf, module._buffers.get(leaf))
                if old is not None and (tuple(old.shape) != tuple(tensor.shape) or old.dtype != tensor.dtype):
                    raise WeightCacheUnavailableError(
                        f"daemon tensor {name} is {tensor.dtype}{list(tensor.shape)}, the model wants "
                        f"{old.dtype}{list(old.shape)}")
                # Remembered for an undo: vLLM shares some modules between
                # models (its rotary-embedding cache), so a failed attach
                # must put back what it replaced, or the arena stays mapped.
                self._undo.append((module, leaf, module._parameters.get(leaf), module._buffers.get(leaf),
                                   leaf in module._parameters, leaf in module._buffers))
                module._parameters.pop(leaf, None)
                module._buffers.pop(leaf, None)
                obj: torch.Tensor
                if is_param:
                    obj = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)
                    if old is not None:
                        # weight_loader and friends live on the Parameter object.
                        obj.__dict__.update({k: v for k, v in old.__dict__.items() if k not in obj.__dict__})
                    module.register_parameter(leaf, obj)
                else:
                    obj = tensor
                    module.register_buffer(leaf, obj)
                registered[name] = obj

            with _phase(event, "register"):
                for name, tensor in attachment.tensors.items():
                    register(name, tensor.clone() if self.opts.mode == "copy" else tensor, kinds[name] == "param")
            for alias, canonical in state.aliases.items():
                if canonical not in registered:
                    raise WeightCacheUnavailableError(f"alias {alias} names missing tensor {canonical}")
                register(alias, registered[canonical], isinstance(registered[canonical], nn.Parameter))
            missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
            if missing:
                raise WeightCacheUnavailableError(
                    f"the daemon did not provide {len(missing)} tensors, e.g. {missing[:3]}")
            if resident.should_verify(self.opts, state):
                with _phase(event, "verify"):
                    resident.verify_attached(attachment.tensors, state)
            with _phase(event, "process"):
                if state.stage == "processed":
                    with weights_already_processed():
                        process_weights_after_loading(model, model_config, device)
                else:
                    process_weights_after_loading(model, model_config, device)
        return model.eval()
