"""A tensor stored in two files: refused by name in every stage.

Why refuse rather than resolve: vLLM's ``safetensors_weights_iterator``
(asked here, no engine) yields both copies, in the order of the file list
``_prepare_weights`` returns, which is ``glob``'s directory order (not
sorted); a plain weight loader copies each in turn, so the copy kept is the
one the filesystem lists last. There is no stable answer to mirror, so
``promote``, the raw daemon and the loaded daemon refuse such a checkpoint
with one line naming the tensor and both files. Control: the same folder
without the second copy promotes.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

from safetensors.numpy import save_file  # noqa: E402

from pgbase.errors import CheckpointError  # noqa: E402
from pgbase.fileset import vllm_selection  # noqa: E402
from preload.identity.manifest import build_manifest  # noqa: E402

pytestmark = pytest.mark.cpu


@pytest.fixture
def twice(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({"w": np.zeros(4, dtype=np.float32), "a": np.ones(2, dtype=np.float32)}, str(d / "a.safetensors"))
    save_file({"w": np.full(4, 7, dtype=np.float32)}, str(d / "b.safetensors"))
    return d


def test_vllm_yields_both_copies_in_listing_order(twice):
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    fs = vllm_selection(twice)
    assert fs.files == ("a.safetensors", "b.safetensors")
    import glob
    import os

    listed = glob.glob(os.path.join(twice, "*.safetensors"))  # _prepare_weights' order
    seen = [(n, float(t[0])) for n, t in safetensors_weights_iterator(listed, False) if n == "w"]
    assert len(seen) == 2
    last = seen[-1][1]
    assert last == (7.0 if listed[-1].endswith("b.safetensors") else 0.0)


def test_promote_refuses_naming_the_tensor_and_both_files(twice):
    with pytest.raises(CheckpointError) as info:
        build_manifest(twice, progress=False)
    msg = str(info.value)
    assert "'w'" in msg and "a.safetensors" in msg and "b.safetensors" in msg and "\n" not in msg


def test_raw_and_loaded_daemons_refuse_too(twice):
    from preload.daemon.loaded import ProvenWeights
    from preload.daemon.raw import fill_raw
    from preload.transports import get_transport

    with pytest.raises(CheckpointError, match="is stored in both"):
        fill_raw(twice, get_transport("shm"), None)
    with pytest.raises(CheckpointError, match="is stored in both"):
        ProvenWeights(str(twice))


def test_control_one_copy_promotes(twice):
    (twice / "b.safetensors").unlink()
    assert [s.name for s in build_manifest(twice, progress=False).shards] == ["a.safetensors"]
