"""Which stage and transport an engine on this host asks a daemon for.

One rule for the daemon's defaults (``preload`` without ``--stage`` or
``--transport``), for the refusal of explicit choices no engine here can use,
and for the key the ``verified_cache`` loader asks with
(:func:`preload.vllm_key.export_stage_for`). The platform is vLLM's to
decide (``vllm.platforms.current_platform.device_type``): ``cuda`` engines
attach ``processed`` weights over ``cuda`` (vLLM's own ``ipc_cache`` serves
that stage: weight_cache/daemon.py exports after
``process_weights_after_loading``), ``cpu`` engines the ``loaded`` stage over
``shm`` (CPU processing packs Linear weights into oneDNN handles that cannot
be shared), and a host without vLLM gets the ``raw`` stage for other
consumers (:mod:`preload.hf_attach`), on the GPU when torch sees one, as
``attach_model``'s default device is.

>>> for_device("cuda")
('processed', 'cuda')
>>> for_device("cpu")
('loaded', 'shm')
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from pgbase.errors import PreloadGateError

# (stage, transport) a vLLM engine of each platform device type attaches.
ENGINE_SURFACE = {"cuda": ("processed", "cuda"), "cpu": ("loaded", "shm")}


def for_device(device_type: str) -> tuple[str, str]:
    """The ``(stage, transport)`` a vLLM engine on ``device_type`` asks for.
    Device types vLLM shares CUDA's runtime with (ROCm reports ``cuda``)
    follow CUDA; anything else is CUDA's rule too, as vLLM's ipc_cache
    refuses every platform but CUDA/ROCm."""
    return ENGINE_SURFACE.get(device_type, ENGINE_SURFACE["cuda"])


def host_device_type() -> str | None:
    """vLLM's platform device type on this host (``cuda``, ``cpu``, ...),
    or None when vLLM is not installed or names no platform. Imports vLLM's
    platform module (a few seconds: it imports torch). A vLLM that is
    installed but fails to import is a PreloadGateError naming the error:
    guessing ``raw`` there would start a daemon no engine attaches."""
    if importlib.util.find_spec("vllm") is None:
        return None  # no vLLM here: no vLLM engine runs here
    try:
        from vllm.platforms import current_platform  # optional: the stages for vLLM engines
    except Exception as exc:  # noqa: BLE001 - installed but broken: say so, never guess raw
        raise PreloadGateError(
            f"vLLM is installed but cannot be imported ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}), "
            "so this host's engine stage is unknown; repair the vLLM install, or pass --stage raw for "
            "consumers without vLLM") from None
    device_type = str(getattr(current_platform, "device_type", "") or "")
    return device_type or None


def _torch_sees_cuda() -> bool:
    try:
        import torch  # optional for a raw-stage host
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def defaults(device_type: str | None) -> tuple[str, str]:
    """The daemon's ``(stage, transport)`` when none is given: what this
    host's vLLM engines attach, else ``raw`` on the GPU (or shm)."""
    if device_type is not None:
        return for_device(device_type)
    return "raw", "cuda" if _torch_sees_cuda() else "shm"


def resolve(stage: str | None, transport: str | None,
            device_type_of: Callable[[], str | None] = host_device_type) -> tuple[str, str]:
    """``--stage``/``--transport`` as given, the missing ones filled by
    this host's rule; a combination no consumer on this host can attach is a
    PreloadGateError (one line naming the host's platform and what to pass).
    ``device_type_of`` (vLLM's platform, :func:`host_device_type`) is asked
    only when a vLLM stage may be involved: ``raw`` needs no vLLM."""
    if stage == "raw":
        return "raw", transport or ("cuda" if _torch_sees_cuda() else "shm")
    device_type = device_type_of()
    if stage is None and transport is None:
        return defaults(device_type)
    if device_type is None:
        if stage is None and transport is not None:
            return "raw", transport  # no vLLM: only raw consumers
        raise PreloadGateError(
            f"--stage {stage} is for vLLM engines and vLLM cannot be imported here; install vLLM, or use "
            "--stage raw for other consumers (preload.hf_attach)")
    want_stage, want_transport = for_device(str(device_type))
    if stage is None:
        # a transport alone: the vLLM stage that goes with it, if an engine here asks for it
        stage = want_stage if transport == want_transport else None
        if stage is None:
            other = (f", or pass --stage raw --transport {transport} for other consumers"
                     if transport != "cuda" or _torch_sees_cuda() else "")
            raise PreloadGateError(
                f"--transport {transport} serves no vLLM engine on this host (vLLM's platform is "
                f"{device_type}: its engines attach --stage {want_stage} --transport {want_transport}); "
                f"leave both out{other}")
    asked = f"--stage {stage}" + (f" --transport {transport}" if transport else "")
    transport = transport or want_transport
    if (stage, transport) != (want_stage, want_transport):
        raise PreloadGateError(
            f"{asked} serves no engine on this host: vLLM's platform is "
            f"{device_type} and its engines attach --stage {want_stage} --transport {want_transport} "
            "(leave both out for that), or use --stage raw for other consumers (preload.hf_attach)")
    return stage, transport


__all__ = ["ENGINE_SURFACE", "defaults", "for_device", "host_device_type", "resolve"]
