"""The one dtype table: what safetensors and torch share, asked of both.

Nothing here is written by hand. Each fact comes from the library that owns it:

- the safetensors format codes (``"F8_E8M0"``...) are the installed
  library's own: the variants its header parser names when it refuses an
  unknown one (:func:`safetensors_codes`);
- bits per stored value are the library's: the one data length its
  ``deserialize`` accepts for eight values of a code (:func:`code_bits`;
  ``F4`` is 4 bits, ``F6_E2M3`` 6);
- which torch dtype a code is: every ``torch.dtype`` attribute of the
  installed torch, named as ``safetensors.torch.save_file`` names it
  (``str(dtype).split(".")[-1]``) and handed to the library's own
  ``TensorSpec``, which says the code it writes for it and how many stored
  values one torch element packs (``float4_e2m1fn_x2``: two ``F4`` values);
- bytes per torch element are torch's (``dtype.itemsize``), and must equal
  the library's bits times that packing, or the pair is not shared.

So a dtype a new safetensors or torch release adds is served, tested and
refused by the same table without a change here. The safetensors part needs
no torch (fixtures write shards with numpy alone); :func:`shared` imports
torch on first use, which is why this pgbase module is the one that may.
Tables are built once per process (``functools.cache``).

>>> shared()["F8_E8M0"].torch  # doctest: +SKIP
torch.float8_e8m0fnu
"""

from __future__ import annotations

import functools
import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from pgbase.errors import CheckpointError

if TYPE_CHECKING:
    import torch

    from pgbase.shards import ShardHeader

# A code no safetensors release defines: its refusal lists those it does.
_PROBE_CODE = "PG_NO_SUCH_DTYPE"
_VARIANTS = re.compile(r"expected one of (.*?)(?: at line \d+|$)")
# Stored values per probe tensor: any bit width from 1 to 64 gives a whole byte count.
_PROBE_VALUES = 8


@dataclass(frozen=True)
class DType:
    """One dtype both libraries know.

    ``code``: the safetensors header's name (``"F8_E8M0"``); ``torch``: the
    torch dtype ``safe_open(framework="pt")`` loads it as; ``name``: that
    dtype's name on our wire (``"float8_e8m0fnu"``); ``itemsize``: bytes per
    torch element; ``bits``: bits per value stored in the file;
    ``per_element``: stored values one torch element packs (2 for ``F4``,
    whose torch tensor's last dimension is half the header's).
    """

    code: str
    torch: torch.dtype
    name: str
    itemsize: int
    bits: int
    per_element: int


def versions() -> str:
    """``"safetensors X, torch Y"`` as installed (torch only if importable)."""
    import safetensors

    try:
        import torch
    except ImportError:
        return f"safetensors {safetensors.__version__}, torch not installed"
    return f"safetensors {safetensors.__version__}, torch {torch.__version__}"


@functools.cache
def safetensors_codes() -> tuple[str, ...]:
    """Every dtype code the installed safetensors parses, in its own order.

    Read from the library's refusal of a code it does not know (its header
    parser lists the variants it expects). RuntimeError naming the version
    if that refusal no longer lists them: the table cannot be built, and a
    guess would drift.
    """
    import safetensors

    blob = json.dumps({"t": {"dtype": _PROBE_CODE, "shape": [0], "data_offsets": [0, 0]}}).encode()
    try:
        safetensors.deserialize(struct.pack("<Q", len(blob)) + blob)
    except Exception as exc:  # SafetensorError: the answer asked for
        found = _VARIANTS.search(str(exc))
        if found:
            codes = tuple(re.findall(r"`([^`]+)`", found.group(1)))
            if codes:
                return codes
        raise RuntimeError(
            f"cannot read the dtype list of safetensors {safetensors.__version__} from its "
            f"refusal of an unknown dtype ({exc}); preload-gate needs a fix for this version"
        ) from exc
    raise RuntimeError(
        f"safetensors {safetensors.__version__} accepted the dtype {_PROBE_CODE}; "
        "preload-gate cannot tell which dtypes it knows"
    )


def _accepts(code: str, nbytes: int) -> bool:
    import safetensors

    blob = json.dumps(
        {"t": {"dtype": code, "shape": [_PROBE_VALUES], "data_offsets": [0, nbytes]}}
    ).encode()
    try:
        safetensors.deserialize(struct.pack("<Q", len(blob)) + blob + bytes(nbytes))
    except Exception:  # SafetensorError: this length is not the code's
        return False
    return True


@functools.cache
def _bits_table() -> Mapping[str, int]:
    out = {}
    for code in safetensors_codes():
        # n bytes hold 8 values of n bits: the one length the library accepts.
        found = [n for n in range(1, 8 * _PROBE_VALUES + 1) if _accepts(code, n)]
        if len(found) == 1:
            out[code] = found[0]
    return MappingProxyType(out)


def code_bits(code: str) -> int | None:
    """Bits per stored value of safetensors ``code`` (16 for ``"BF16"``, 4
    for ``"F4"``), as the library sizes its data; None for a code it does not know."""
    return _bits_table().get(code)


def data_nbytes(code: str, shape: tuple[int, ...]) -> int:
    """Bytes the data of a ``code`` tensor of header ``shape`` takes, by the
    library's bit size (ValueError for an unknown code or a partial byte)."""
    bits = code_bits(code)
    if bits is None:
        import safetensors

        raise ValueError(f"safetensors {safetensors.__version__} has no dtype {code!r}")
    n = 1
    for d in shape:
        n *= d
    if (n * bits) % 8:
        raise ValueError(f"{n} values of {code} ({bits} bits each) do not fill whole bytes")
    return n * bits // 8


def _spec(name: str, values: int, nbytes: int) -> Any:
    from safetensors import TensorSpec

    return TensorSpec(dtype=name, shape=[values], data_ptr=0, data_len=nbytes)


@functools.cache
def _tables() -> tuple[Mapping[str, DType], Mapping[str, str]]:
    import torch

    shared_by_code: dict[str, DType] = {}
    unshared: dict[str, str] = {}
    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    for dt in sorted(dtypes, key=str):
        name = str(dt).split(".")[-1]  # as safetensors.torch._flatten_as_ptr names it
        try:
            spec = _spec(name, 1, dt.itemsize)
        except Exception:  # SafetensorError: a torch dtype safetensors does not store
            continue
        code, per_element = str(spec.dtype), int(spec.shape[-1])
        bits = code_bits(code)
        if bits is None or bits * per_element != 8 * dt.itemsize:
            unshared[code] = (
                f"torch.{name} is {dt.itemsize} byte(s) per element and safetensors writes it as "
                f"{per_element} {code} value(s) of {bits} bits"
            )
            continue
        shared_by_code[code] = DType(code, dt, name, dt.itemsize, bits, per_element)
    return MappingProxyType(shared_by_code), MappingProxyType(unshared)


def shared() -> Mapping[str, DType]:
    """The dtypes safetensors and torch share, by safetensors code.

    >>> sorted(shared())[:3]  # doctest: +SKIP
    ['BF16', 'BOOL', 'C64']
    """
    return _tables()[0]


@functools.cache
def _by_name() -> Mapping[str, DType]:
    return MappingProxyType({d.name: d for d in shared().values()})


def by_name(name: str) -> DType:
    """The shared dtype our wire names ``name`` (``"float8_e8m0fnu"``);
    ValueError naming the known ones otherwise."""
    try:
        return _by_name()[name]
    except KeyError:
        raise ValueError(
            f"dtype {name!r} is none that safetensors and torch share ({versions()}): "
            f"one of {', '.join(sorted(_by_name()))}"
        ) from None


def by_torch(dtype: torch.dtype) -> DType:
    """The shared dtype of a torch dtype; ValueError if safetensors cannot store it."""
    return by_name(str(dtype).split(".")[-1])


def for_tensor(tensor: str, code: str, shape: tuple[int, ...], shard: str | None = None) -> DType:
    """The shared dtype of a checkpoint tensor, checked as a torch tensor can hold it.

    CheckpointError (one line: the tensor, the dtype, the versions) when
    safetensors knows ``code`` but torch has no type for it (``F6_E2M3``),
    or a packed code's last dimension does not divide into torch elements
    (``F4`` with an odd last dimension): no stage could serve it, so
    ``promote`` refuses it before the first weight byte.
    """
    found = shared().get(code)
    if found is None:
        why = _tables()[1].get(code) or "torch has no type for it"
        raise CheckpointError(
            f"tensor {tensor!r} has dtype {code}, which preload-gate cannot serve: {why} "
            f"({versions()}); convert the tensor to a dtype torch has",
            shard,
        )
    if found.per_element > 1 and shape and shape[-1] % found.per_element:
        raise CheckpointError(
            f"tensor {tensor!r}: {code} packs {found.per_element} values per torch element and "
            f"the last dimension {shape[-1]} does not divide; torch cannot hold it ({versions()})",
            shard,
        )
    return found


def check_header(header: ShardHeader) -> None:
    """:func:`for_tensor` for every tensor of a validated shard header: the
    first one no stage could serve is a CheckpointError naming it."""
    for t in header.tensors:
        for_tensor(t.name, t.dtype, t.shape, header.name)


def torch_shape(found: DType, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A header ``shape`` as the torch tensor has it (a packed code's last
    dimension divided by its packing); call :func:`for_tensor` first."""
    if found.per_element == 1 or not shape:
        return shape
    return (*shape[:-1], shape[-1] // found.per_element)
