"""Checks that need no weights, run before the first weight byte is read.

A socket path over the AF_UNIX limit, a socket root under a missing
directory, a rank lock another daemon holds, a busy ``--health-port``, a
``--dtype`` vLLM does not take, a ``--tensor-parallel-size`` that does not
divide the model's heads (read from ``config.json``), a manifest cache or
report directory that cannot be written or cannot be trusted: each is known
in milliseconds, so none may cost a user a whole load and then a traceback.
Each check raises :class:`PreflightError`, one line naming the thing and the
fix, and creates nothing (a lock is probed on an existing file only, a port
is bound and released at once).

>>> preflight_daemon(socket_root="/run/user/1000/pg", ranks=[0], health_port=None)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from pgbase.errors import PreloadGateError
from preload import trust

# sun_path is 108 bytes on Linux, one of them the terminating NUL.
AF_UNIX_MAX = 107
_DIGEST_PREFIX = 16


class PreflightError(PreloadGateError):
    """A check that needs no weights failed; the message names the fix."""


def socket_path_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be bound or connected as an AF_UNIX socket, or None."""
    n = len(os.fsencode(os.fspath(path)))
    if n > AF_UNIX_MAX:
        return (f"socket path {path} is {n} bytes, over the AF_UNIX limit of {AF_UNIX_MAX}; "
                f"use a shorter --socket-root (or PRELOAD_GATE_SOCKET_ROOT)")
    return None


def check_socket_root(root: str | os.PathLike[str], ranks: Iterable[int] = (0,), probe: bool = False) -> None:
    """The socket paths fit AF_UNIX, the root's parent exists, the root (if it
    exists) is private. The digest directory is ``<root>/<16 hex>``, so its
    length is known before the digest is. ``probe``: a root that does not
    exist yet is proven creatable by making and removing a directory beside it."""
    r = Path(root)
    for rank in ranks:
        problem = socket_path_problem(r / ("0" * _DIGEST_PREFIX) / f"rank{rank}.sock")
        if problem:
            raise PreflightError(problem.replace(f"{r}/{'0' * _DIGEST_PREFIX}", f"{r}/<digest16>"))
    parent = r.parent
    if not parent.is_dir():
        raise PreflightError(f"the socket root's parent directory {parent} does not exist; "
                             f"create it (mkdir -p {parent}) or choose another --socket-root")
    if os.path.lexists(r):
        try:
            trust.verify_private_dir(r, "socket root")
        except trust.UntrustedPathError as exc:
            raise PreflightError(str(exc)) from exc
    elif not os.access(parent, os.W_OK | os.X_OK):
        raise PreflightError(f"cannot create the socket root {r}: {parent} is not writable; "
                             f"choose another --socket-root")
    elif probe:
        # os.access says yes to root on /proc or a read-only mount: make and
        # remove one directory, so a rank process does not find out later.
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".preload-gate-probe-", dir=parent))
        except OSError as exc:
            raise PreflightError(f"cannot create the socket root {r}: making a directory in {parent} failed "
                                 f"({exc.strerror or exc}); choose a writable --socket-root") from None


def check_rank_locks(socket_dir: str | os.PathLike[str], ranks: Iterable[int]) -> None:
    """No other daemon holds a rank's lock in ``socket_dir`` (probed on an
    existing lock file only; nothing is created)."""
    from preload.daemon.lock import lock_path

    for rank in ranks:
        path = lock_path(socket_dir, rank)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise PreflightError(f"cannot open the rank lock {path}: {exc.strerror}; remove it") from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                raise PreflightError(
                    f"another daemon (pid {holder}) already serves rank {rank} in {socket_dir}; "
                    "stop it first (preload-gate status lists it)") from None
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def check_port(host: str, port: int) -> None:
    """``host:port`` can be bound now (as the health server binds it)."""
    if not 0 <= port <= 65535:
        raise PreflightError(f"--health-port {port} is not a TCP port (0-65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise PreflightError(f"--health-host {host} does not resolve: {exc.strerror}") from exc
    family, _, _, _, addr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server does
        s.bind(addr)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PreflightError(f"--health-port {port} on {host} is already in use; choose another "
                                 f"port or stop what holds it (ss -ltnp 'sport = :{port}')") from exc
        raise PreflightError(f"cannot bind --health-port {port} on {host}: {exc.strerror}") from exc
    finally:
        s.close()


def check_cache_dir(cache_dir: str | os.PathLike[str] | None, checkpoint: str | os.PathLike[str] | None = None,
                    write: bool = True) -> None:
    """The manifest directory can be written (or created) and, where it or the
    checkpoint's manifest exists, is trusted."""
    from preload.identity.manifest import default_cache_dir, manifest_path

    base = Path(cache_dir) if cache_dir else default_cache_dir()
    mdir = base / "manifests"
    try:
        if os.path.lexists(mdir) and not (write and _own_real_dir(mdir)):
            # (our own loose directory is tightened by the write: identity.manifest)
            trust.verify_private_dir(mdir, "manifest directory")
        if checkpoint is not None:
            mpath = manifest_path(checkpoint, base)
            if os.path.lexists(mpath):
                trust.verify_private_file(mpath, "manifest")
    except trust.UntrustedPathError as exc:
        raise PreflightError(str(exc)) from exc
    if not write:
        return
    probe = mdir
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise PreflightError(f"the manifest cache {mdir} cannot be created: {probe} is not a directory; "
                             f"set --cache-dir or PRELOAD_GATE_CACHE to a writable directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        where = "" if probe == mdir else f" (its nearest existing parent {probe})"
        raise PreflightError(f"the manifest cache {mdir}{where} is not writable; set --cache-dir "
                             f"or PRELOAD_GATE_CACHE to a writable directory")
    try:
        st = os.statvfs(probe)
    except OSError:
        st = None
    if st is not None and st.f_flag & os.ST_RDONLY:
        raise PreflightError(f"the manifest cache {mdir} is on a read-only filesystem; set --cache-dir "
                             f"or PRELOAD_GATE_CACHE to a writable directory")
    # The checks above answer for an ordinary user; root passes os.access
    # everywhere (even under /proc), so the directory is made here, 0700, as
    # the write would make it: a cache that cannot exist fails before hashing.
    # What this made is removed again (a refusal later leaves nothing behind).
    from preload.identity.manifest import prepare_manifest_dir

    made = [d for d in (mdir, *mdir.parents) if not os.path.lexists(d)]
    try:
        prepare_manifest_dir(mdir)
        for d in made:  # deepest first; only the empty levels this call made
            with contextlib.suppress(OSError):
                os.rmdir(d)
    except (PreloadGateError, OSError) as exc:
        why = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
        why_text = why.strerror if isinstance(why, OSError) and why.strerror else str(why)
        raise PreflightError(f"the manifest cache {mdir} cannot be created: {why_text}; set --cache-dir "
                             f"or PRELOAD_GATE_CACHE to a writable directory") from exc


# The ``--dtype`` strings vLLM takes: "auto" and the keys of
# ``vllm.config.model._STR_DTYPE_TO_TORCH_DTYPE`` (its ``ModelDType``), compared
# lowercased as ``_get_and_verify_dtype`` does. Held equal to the installed
# vLLM by tests/cpu/test_preflight_vllm_rules.py.
VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


def check_dtype(dtype: str) -> None:
    """``dtype`` is one vLLM's ``--dtype`` takes (rule: vLLM's
    ``_get_and_verify_dtype``, which raises ``Unknown dtype`` for any other).

    Raises :class:`PreflightError` naming the accepted values."""
    if dtype.lower() not in VLLM_DTYPES:
        raise PreflightError(f"--dtype {dtype!r} is not a dtype vLLM takes; use one of {', '.join(VLLM_DTYPES)}")


def check_cuda(transport: str) -> None:
    """``--transport cuda`` has a CUDA device to put weights on."""
    if transport != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise PreflightError("--transport cuda needs a CUDA device and none is visible (torch.cuda.is_available() "
                             "is False: no GPU, no driver, a CPU-only torch or CUDA_VISIBLE_DEVICES hides them); "
                             "use --transport shm")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """vLLM logs on import (Triton notes) and while it splits layers: a
    refusal must stay one line on stderr."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def _vllm_choices(flag: str) -> tuple[str, ...] | None:
    """The values vLLM's own config takes for ``flag`` (its Literal types), or
    None where vLLM is not importable (nothing to check; vLLM decides later)."""
    from typing import get_args

    try:
        with _quiet():
            if flag == "--kv-cache-dtype":
                from vllm.config.cache import CacheDType

                return tuple(get_args(CacheDType))
            from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

            return tuple(QUANTIZATION_METHODS)
    except ImportError:
        return None


def check_engine_choices(engine: dict[str, object]) -> None:
    """``--kv-cache-dtype`` and ``--quantization`` are values vLLM takes. vLLM
    is imported only for a value other than the default, so a plain start
    costs no import."""
    for flag, key, default in (("--kv-cache-dtype", "kv_cache_dtype", "auto"), ("--quantization", "quantization", None)):
        value = engine.get(key)
        if value is None or value == default:
            continue
        choices = _vllm_choices(flag)
        if choices is not None and value not in choices:
            raise PreflightError(f"{flag} {value!r} is not one vLLM takes; use one of {', '.join(choices)}")


def check_pipeline_parallel(checkpoint: str | os.PathLike[str], pp_size: int) -> None:
    """Every pipeline stage holds at least one of the model's hidden layers,
    split as vLLM's ``get_pp_indices`` splits them (``VLLM_PP_LAYER_PARTITION``
    included) where vLLM is importable, evenly otherwise."""
    if pp_size <= 1:
        return
    from preload.identity.manifest import read_config

    cfg = read_config(checkpoint)
    if not isinstance(cfg, dict):
        return
    text = cfg.get("text_config")
    if "num_hidden_layers" not in cfg and isinstance(text, dict):
        cfg = text
    layers = cfg.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        return
    with _quiet():
        try:
            from vllm.distributed.utils import get_pp_indices
        except ImportError:
            sizes = [layers // pp_size + (r < layers % pp_size) for r in range(pp_size)]
        else:
            try:
                sizes = [end - start for start, end in (get_pp_indices(layers, r, pp_size) for r in range(pp_size))]
            except ValueError as exc:
                raise PreflightError(f"--pipeline-parallel-size {pp_size}: {exc} (VLLM_PP_LAYER_PARTITION)") from None
    if min(sizes) < 1:
        raise PreflightError(f"--pipeline-parallel-size {pp_size} leaves a stage with no layer of the model's "
                             f"{layers} hidden layers (config.json; split {sizes}); choose at most {layers}")


def model_heads(checkpoint: str | os.PathLike[str]) -> tuple[int, int] | None:
    """``(num_attention_heads, num_key_value_heads)`` from the checkpoint's
    ``config.json`` (its ``text_config`` for a multimodal config, as vLLM's
    ``hf_text_config``; key/value heads default to the attention heads, as
    vLLM's ``get_total_num_kv_heads`` does). None when there is no
    ``config.json`` or it names no head count (nothing to check here; vLLM
    decides later). Reads one small file, no weights.

    Raises :class:`~pgbase.errors.CheckpointError` when ``config.json`` is not readable JSON."""
    from preload.identity.manifest import read_config

    cfg = read_config(checkpoint)
    if not isinstance(cfg, dict):
        return None
    text = cfg.get("text_config")
    if "num_attention_heads" not in cfg and isinstance(text, dict):
        cfg = text
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        return None
    if not isinstance(kv, int) or isinstance(kv, bool) or kv < 1:
        kv = heads
    return heads, kv


def _tp_fits(tp: int, heads: int, kv: int) -> bool:
    # vLLM's ModelConfig.verify_with_parallel_config: heads % tp == 0.
    # vLLM's QKVParallelLinear: KV heads are split when tp < kv (kv % tp == 0)
    # and replicated when tp >= kv (tp % kv == 0).
    return heads % tp == 0 and (kv % tp == 0 if tp < kv else tp % kv == 0)


def check_tensor_parallel(checkpoint: str | os.PathLike[str], tp_size: int) -> None:
    """``tp_size`` splits the model's attention and key/value heads the way
    vLLM can. Rules (vLLM's, not ours): ``ModelConfig.verify_with_parallel_config``
    refuses ``num_attention_heads % tensor_parallel_size != 0``; the attention
    layer (``QKVParallelLinear``) divides the key/value heads across ranks when
    there are more of them than ranks, and replicates them evenly otherwise,
    so ``num_key_value_heads % tp`` (or ``tp % num_key_value_heads``) must be 0.
    Held equal to the installed vLLM by tests/cpu/test_preflight_vllm_rules.py.

    Raises :class:`PreflightError` naming the head counts and the sizes that fit."""
    if tp_size < 1:
        return  # placement refuses it, with its own message
    counts = model_heads(checkpoint)
    if counts is None:
        return
    heads, kv = counts
    if _tp_fits(tp_size, heads, kv):
        return
    fits = [t for t in range(1, heads + 1) if _tp_fits(t, heads, kv)]
    what = (f"{heads} attention heads (config.json)" if heads % tp_size else
            f"{kv} key/value heads (config.json; vLLM splits them when tp < {kv}, replicates them when tp >= {kv})")
    raise PreflightError(f"--tensor-parallel-size {tp_size} does not fit the model's {what}; "
                         f"choose a tensor-parallel size from {fits}")


def check_output_dir(path: str | os.PathLike[str], flag: str) -> None:
    """``path`` (a directory a verb will write, given as ``flag``) exists as a
    writable directory or can be created, checked before anything runs.

    It is probed by making and removing one temporary directory in ``path`` or
    its nearest existing parent: ``os.access`` answers for permission bits
    only, and says yes to root on /proc, a root-squashed NFS export or a full
    quota. Nothing is left behind.

    Raises :class:`PreflightError` naming the directory and the fix."""
    out = Path(path)
    probe = out
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        what = "is not a directory" if probe == out else f"cannot be created: its parent {probe} is not a directory"
        raise PreflightError(f"{flag} {out} {what}; choose a writable {flag} directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".preload-gate-probe-", dir=probe))
    except OSError as exc:
        raise PreflightError(f"{flag} {out} cannot be written: making a directory in {probe} failed "
                             f"({exc.strerror or exc}); choose a writable {flag} directory") from exc


def _own_real_dir(path: Path) -> bool:
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def check_checkpoint(checkpoint: str | os.PathLike[str]) -> None:
    p = Path(checkpoint)
    if not p.exists():
        raise PreflightError(f"checkpoint directory {p} does not exist")
    if not p.is_dir():
        raise PreflightError(f"checkpoint {p} is not a directory")
    if not os.access(p, os.R_OK | os.X_OK):
        raise PreflightError(f"checkpoint directory {p} is not readable")


def preflight_daemon(checkpoint: str | os.PathLike[str], socket_root: str | os.PathLike[str] | None,
                     ranks: Iterable[int], digest: str | None, health_host: str = "127.0.0.1",
                     health_port: int | None = None, dtype: str = "auto", tp_size: int = 1,
                     pp_size: int = 1, transport: str = "shm", engine: dict[str, object] | None = None) -> None:
    """Everything ``preload`` (and its ``--dry-run``) can check before it reads a weight byte."""
    from preload.sockets import default_socket_root, socket_dir

    ranks = list(ranks)
    check_checkpoint(checkpoint)
    check_dtype(dtype)
    check_engine_choices(engine or {})
    check_tensor_parallel(checkpoint, tp_size)
    check_pipeline_parallel(checkpoint, pp_size)
    root = Path(socket_root) if socket_root else default_socket_root()
    check_socket_root(root, ranks, probe=True)
    if digest is not None:
        sdir = socket_dir(digest, root)
        if os.path.lexists(sdir):
            try:
                trust.verify_private_dir(sdir, "socket directory")
            except trust.UntrustedPathError as exc:
                raise PreflightError(str(exc)) from exc
            check_rank_locks(sdir, ranks)
    if health_port is not None:
        check_port(health_host, health_port)
    check_cuda(transport)


def preflight_promote(checkpoint: str | os.PathLike[str], socket_root: str | os.PathLike[str] | None,
                      cache_dir: str | os.PathLike[str] | None) -> None:
    """Everything ``promote`` can check before it hashes a byte."""
    from preload.sockets import default_socket_root

    check_checkpoint(checkpoint)
    check_socket_root(Path(socket_root) if socket_root else default_socket_root())
    check_cache_dir(cache_dir, checkpoint)
