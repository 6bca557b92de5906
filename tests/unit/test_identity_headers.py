"""A shard is valid exactly when the safetensors library says so: a differential test.

Hypothesis generates safetensors files (tensor names, every dtype the
library knows and some it does not, shapes with zero-size dimensions and
scalars, well-formed and broken offsets, ``__metadata__`` as strings,
numbers, objects, null, lists; padding, duplicate keys, trailing bytes,
header lengths past the file). For each one:

- ``read_header`` (promote's validator) accepts iff ``safetensors.safe_open``
  (framework ``pt``) opens it, with the same names, dtypes and shapes;
- the raw stage's reader (``ProvenShard``, which hashes as it reads) yields,
  for every tensor the library's ``get_tensor`` loads, the same torch dtype,
  shape and bytes, and refuses the tensors the library cannot load.

At least 10,000 files. Control: a validator that accepts one thing too many
(any ``__metadata__`` value, as this project once did) is caught by the
same comparison.
"""

from __future__ import annotations

import json
import math
import os
import random
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from pgbase import dtypes
from pgbase.errors import CheckpointError
from pgbase.shards import read_header
from preload.daemon.proof import ProvenShard, torch_dtype, torch_shape

pytestmark = pytest.mark.unit

N_FILES = 10_000
# Every dtype the installed safetensors knows (pgbase.dtypes reads them from the
# library itself, F8 variants and sub-byte F4/F6 included), bytes per value by
# the library's own bit sizes; and some dtypes it does not know.
DTYPE_BYTES = {c: dtypes.code_bits(c) / 8 for c in dtypes.safetensors_codes()}
UNKNOWN_DTYPES = ["F8", "FP32", "f32", "Q4_0", "F8_E4M3FN", ""]

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=0, max_size=6)
dims = st.lists(st.integers(0, 4) | st.sampled_from([-1, 2**40]), min_size=0, max_size=3)
meta_values = st.none() | st.dictionaries(
    st.text(max_size=3),
    st.text(max_size=3) | st.integers(-2, 2) | st.dictionaries(st.text(max_size=2), st.text(max_size=2), max_size=1)
    | st.none(), max_size=2,
) | st.lists(st.text(max_size=2), max_size=1) | st.text(max_size=2) | st.integers(0, 2)


@st.composite
def shard_files(draw) -> bytes:
    """One safetensors file's bytes: half are drawn well-formed (any names,
    dtypes, shapes, string metadata), half broken in one of many ways."""
    good = draw(st.booleans())
    codes = st.sampled_from(list(DTYPE_BYTES))
    if not good:
        codes = codes | st.sampled_from(UNKNOWN_DTYPES)
    shapes = st.lists(st.integers(0, 4), max_size=3) if good else dims
    tensors = draw(st.lists(st.tuples(names, codes, shapes), max_size=4, unique_by=lambda t: t[0]))
    header: dict[str, object] = {}
    data = b""
    for name, dtype, shape in tensors:
        if name == "__metadata__":
            continue
        n = math.prod(shape) if all(0 <= d < 2**20 for d in shape) else 1
        nbytes = int(math.ceil(n * DTYPE_BYTES.get(dtype, 1)))
        if not good:
            nbytes = max(0, nbytes + draw(st.sampled_from([0, 0, 0, 1, -1])))
        begin = len(data)
        data += random.Random(draw(st.integers(0, 2**16))).randbytes(nbytes)
        offsets: object = [begin, begin + nbytes]
        how = "ok" if good else draw(st.sampled_from(["ok"] * 4 + ["gap", "overlap", "reversed", "float", "short", "str"]))
        if how == "gap":
            offsets = [begin + 1, begin + nbytes + 1]
        elif how == "overlap" and begin:
            offsets = [begin - 1, begin + nbytes - 1]
        elif how == "reversed":
            offsets = [begin + nbytes, begin]
        elif how == "float":
            offsets = [float(begin), float(begin + nbytes)]
        elif how == "short":
            offsets = [begin]
        elif how == "str":
            offsets = [str(begin), str(begin + nbytes)]
        entry: dict[str, object] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
        if not good and draw(st.integers(0, 10)) == 0:
            entry["extra"] = 1
        header[name] = entry
    if draw(st.booleans()):
        header["__metadata__"] = draw(
            st.none() | st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2) if good else meta_values)
    text = json.dumps(header, ensure_ascii=draw(st.booleans()))
    tweaks = ["none", "pad", "dup", "lead_space"] + ([] if good else ["nan", "trail", "long", "not_obj"] * 2)
    tweak = draw(st.sampled_from(tweaks))
    if tweak == "dup" and header:
        k = next(iter(header))
        text = text[:-1] + "," + json.dumps({k: header[k]})[1:]
    elif tweak == "nan":
        text = text.replace("[", "[NaN,", 1)
    elif tweak == "lead_space":
        text = " " + text
    elif tweak == "not_obj":
        text = json.dumps(list(header))
    blob = text.encode()
    if tweak == "pad":
        blob += b" " * (-len(blob) % 8)
    if tweak == "trail":
        data += b"\0"
    n_header = len(blob) + (len(data) + 9 if tweak == "long" else 0)
    return struct.pack("<Q", n_header) + blob + data


def _library(path: Path) -> dict | None:
    """The library's answer: None (refused) or name -> (dtype, shape, tensor-or-exception)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            out = {}
            for k in f.keys():
                sl = f.get_slice(k)
                try:
                    t: object = f.get_tensor(k)
                except Exception as exc:
                    t = exc
                out[k] = (sl.get_dtype(), tuple(sl.get_shape()), t)
            return out
    except Exception:
        return None


def _ours_raw(path: Path) -> dict:
    """The raw stage's reading: ProvenShard in file order, as the daemon reads."""
    shard = ProvenShard(path)
    out: dict[str, object] = {}
    try:
        for info in shard.tensors:
            try:
                torch_dtype(info, shard.name)
                torch_shape(info, shard.name)
            except CheckpointError as exc:
                out[info.name] = exc
                # The daemon refuses the checkpoint here; skip the bytes to finish the pass.
                shard.read_into(info, torch.empty(info.nbytes, dtype=torch.uint8))
                continue
            out[info.name] = shard.read_tensor(info)
        shard.finish()
    finally:
        shard.close()
    return out


def check_one(path: Path, blob: bytes, validate=read_header) -> bool:
    """Assert our answer is the library's for one file; True if it was accepted."""
    path.write_bytes(blob)
    lib = _library(path)
    try:
        ours = validate(path)
    except CheckpointError:
        ours = None
    assert (ours is None) == (lib is None), f"library {'refuses' if lib is None else 'accepts'}, we differ"
    if ours is None or lib is None:
        return False
    assert {t.name: (t.dtype, t.shape) for t in ours.tensors} == {k: v[:2] for k, v in lib.items()}
    raw = _ours_raw(path)
    for k, (_dt, _shape, t) in lib.items():
        mine = raw[k]
        if isinstance(t, Exception):
            assert isinstance(mine, Exception), f"{k}: the library cannot load it, the raw stage did"
            continue
        assert isinstance(mine, torch.Tensor), f"{k}: the library loads it, the raw stage refused: {mine}"
        assert isinstance(t, torch.Tensor)
        assert (mine.dtype, tuple(mine.shape)) == (t.dtype, tuple(t.shape))
        assert _bytes(mine) == _bytes(t), k
    return True


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _scratch(tmp_path: Path) -> Path:
    """A memory-backed directory when there is one: 10,000 files are written."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return Path(tempfile.mkdtemp(prefix="pg-hdr-", dir="/dev/shm"))
    return tmp_path


def test_validator_and_raw_stage_agree_with_safetensors(tmp_path):
    scratch = _scratch(tmp_path)
    path = scratch / "x.safetensors"
    seen = {"n": 0, "accepted": 0, "refused": 0}

    @settings(max_examples=N_FILES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(shard_files())
    def run(blob: bytes) -> None:
        seen["n"] += 1
        seen["accepted" if check_one(path, blob) else "refused"] += 1

    try:
        run()
    finally:
        if scratch != tmp_path:
            import shutil

            shutil.rmtree(scratch, ignore_errors=True)
    assert seen["n"] >= N_FILES, seen
    # Both sides of the line are exercised in earnest.
    assert seen["accepted"] > N_FILES // 10 and seen["refused"] > N_FILES // 10, seen


def _lenient(path: Path):
    """Control: accepts one thing too many (any ``__metadata__`` value), by
    asking the library about the file with its metadata removed."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    try:
        header = json.loads(raw[8 : 8 + n])
        header.pop("__metadata__", None)
    except (ValueError, AttributeError, TypeError):
        return read_header(path)
    blob = json.dumps(header).encode()
    other = path.with_name("lenient.safetensors")
    other.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])
    return read_header(other)


def test_control_a_validator_accepting_any_metadata_is_caught(tmp_path):
    path = tmp_path / "x.safetensors"

    @settings(max_examples=2000, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(shard_files())
    def run(blob: bytes) -> None:
        check_one(path, blob, validate=_lenient)

    with pytest.raises(AssertionError, match="library refuses, we differ"):
        run()


@pytest.mark.parametrize("meta,opens", [({"format": "pt", "step": 1200}, False), (None, True),
                                        ({"format": "pt", "cfg": {"a": "b"}}, False), ({"format": "pt"}, True)])
def test_field_c05_metadata_values(tmp_path, meta, opens):
    """The c05 field inputs, as rows: numbers and objects refused, null and strings accepted."""
    header = {"__metadata__": meta, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    blob = json.dumps(header).encode()
    path = tmp_path / "m.safetensors"
    check_one(path, struct.pack("<Q", len(blob)) + blob + bytes(8))
    if opens:
        read_header(path)
    else:
        with pytest.raises(CheckpointError, match="not a valid safetensors file"):
            read_header(path)


def test_packed_f4_shape_is_the_librarys():
    """F4 packs two values per byte: the torch tensor's last dimension halves, as the library has it."""
    from pgbase.shards import TensorInfo

    info = TensorInfo("w", "F4", (3, 4), 0, 6)
    assert torch_shape(info, "s") == (3, 2)


def test_the_drawn_dtypes_are_the_librarys_table():
    """The files above draw every code the installed safetensors parses (no
    hand list to fall behind a release), sized as torch sizes the shared ones."""
    assert set(DTYPE_BYTES) == set(dtypes.safetensors_codes())
    assert {"F8_E8M0", "F8_E4M3FNUZ", "F4", "F6_E2M3"} <= set(DTYPE_BYTES)
    for code, d in dtypes.shared().items():
        assert DTYPE_BYTES[code] * d.per_element == d.torch.itemsize, code
    assert not set(UNKNOWN_DTYPES) & set(DTYPE_BYTES)
