"""TP slicing rules (transformers' plan, DTensor's split) and the GPU-by-UUID
rank choice, without processes or GPUs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from preload.daemon.placement import PlacementError, rank_on_gpu, visible_uuids
from preload.daemon.tp_slice import TpSliceError, chunk, plan_slices

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def kv2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fixtures.tiny import TinyShape, write_tiny

    return write_tiny(tmp_path_factory.mktemp("kv2") / "ckpt", arch="llama", shape=TinyShape(kv_heads=2))


def _items(ckpt: Path) -> list[tuple[str, list[int]]]:
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        return [(k, f.get_slice(k).get_shape()) for k in f.keys()]


def test_llama_plan_splits_as_transformers_plans_it(kv2: Path) -> None:
    s = plan_slices(kv2, _items(kv2), 2, 1)
    assert (s["model.layers.0.self_attn.q_proj.weight"].style, s["model.layers.0.self_attn.q_proj.weight"].dim) == ("colwise", 0)
    assert s["model.layers.1.mlp.down_proj.weight"].dim == 1 and s["model.layers.1.self_attn.o_proj.weight"].dim == 1
    assert s["lm_head.weight"].dim == 0
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert s[name].dim is None  # not in the plan: replicated
    assert s["model.layers.0.mlp.up_proj.weight"].local_shape((256, 128), 2, 1) == (128, 128)
    assert all(x.dim is None for x in plan_slices(kv2, _items(kv2), 1).values())


def test_chunk_is_torch_chunk_uneven_and_empty() -> None:
    t = torch.arange(5)
    assert chunk(t, 0, 2, 0).tolist() == [0, 1, 2] and chunk(t, 0, 2, 1).tolist() == [3, 4]
    assert chunk(torch.arange(1), 0, 2, 1).numel() == 0


def test_bad_rank_and_unknown_style_are_refused(kv2: Path, tmp_path: Path) -> None:
    with pytest.raises(TpSliceError, match="not a valid rank"):
        plan_slices(kv2, _items(kv2), 2, 2)
    from preload.daemon.tp_slice import style_dim

    with pytest.raises(TpSliceError, match="does not define"):
        style_dim("no_such_style", None, "weight", 2, "x.weight")
    with pytest.raises(TpSliceError, match="not supported at the raw stage"):
        style_dim("packed_colwise", torch.nn.Linear(2, 2), "weight", 2, "x.weight")


def test_fill_raw_tp2_ranks_hold_disjoint_slices_of_the_same_digest(kv2: Path) -> None:
    from safetensors.torch import load_file

    from preload.daemon.raw import fill_raw
    from preload.transports.shm import ShmTransport

    disk = load_file(str(kv2 / "model.safetensors"))
    filled = [fill_raw(kv2, ShmTransport(), None, None, 2, r) for r in (0, 1)]
    whole = fill_raw(kv2, ShmTransport(), None, None)
    try:
        assert filled[0].digest == filled[1].digest == whole.digest
        assert [(f.key.tp_size, f.key.tp_rank) for f in filled] == [(2, 0), (2, 1)]
        name = "model.layers.0.self_attn.o_proj.weight"  # rowwise: columns
        for r, f in enumerate(filled):
            att = ShmTransport().attach(f.arena.descriptor(), [os.dup(fd) for fd in f.arena.fds()], f.layout)
            v = att.tensors[name]
            assert torch.equal(v, disk[name][:, 64 * r: 64 * (r + 1)])
            assert not torch.equal(v, disk[name][64 * r: 64 * (r + 1)])  # control: rows are another split
            assert torch.equal(att.tensors["model.norm.weight"], disk["model.norm.weight"])
            assert f.layout.total_bytes < whole.layout.total_bytes
            att.close()
    finally:
        for f in [*filled, whole]:
            f.arena.close()


def test_engine_picks_its_physical_gpus_daemon_under_any_visible_order() -> None:
    physical = ["GPU-aaaa", "GPU-bbbb"]
    daemons = {0: "GPU-aaaa", 1: "GPU-bbbb"}  # -dp 2 launched with all GPUs visible
    for cvd, want in (("0", 0), ("1", 1), ("1,0", 1), ("0,1", 0), ("GPU-bbbb", 1), ("bb", 1)):
        own = visible_uuids(cvd, physical)[0]  # the engine runs on its cuda:0
        assert rank_on_gpu(daemons, own) == want, cvd
    # Control: choosing by index would attach GPU 0's daemon under "1,0".
    assert daemons[0] != visible_uuids("1,0", physical)[0]
    # TP: rank r's daemon must be of TP rank r on this GPU.
    tp = {0: "GPU-aaaa", 1: "GPU-bbbb"}
    assert rank_on_gpu(tp, "GPU-bbbb", 2, 1) == 1 and rank_on_gpu(tp, "GPU-bbbb", 2, 0) is None
    assert rank_on_gpu({0: "GPU-aaaa"}, "GPU-cccc") is None
    with pytest.raises(PlacementError, match="stop all but one"):
        rank_on_gpu({0: "GPU-aaaa", 1: "GPU-aaaa"}, "GPU-aaaa")
    assert visible_uuids("2", physical) == [] and visible_uuids(None, physical) == physical


def test_load_rank_without_a_daemon_fails_or_falls_back_with_one_event(kv2: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from preload.events import read_events
    from preload.hf_attach import AttachError, load_rank
    empty = tmp_path / "sock"
    empty.mkdir(mode=0o700)
    kw = {"device": "cpu", "socket_dir": empty, "identity": "full", "verify": False, "watch": False}
    with pytest.raises(AttachError, match="rank 0: no daemon for global rank 0.*fallback is off"):
        load_rank(kv2, fallback=False, events_file=str(tmp_path / "off.jsonl"), **kw)
    (off,) = read_events(tmp_path / "off.jsonl")
    assert (off["outcome"], off["rank"], off["source"]) == ("miss", 0, "none")
    got = load_rank(kv2, fallback=True, events_file=str(tmp_path / "on.jsonl"), **kw)
    (on,) = read_events(tmp_path / "on.jsonl")
    assert (on["outcome"], on["source"], got.source) == ("miss", "disk", "disk")
    ref = AutoModelForCausalLM.from_pretrained(str(kv2), dtype=torch.bfloat16).eval()
    ids = torch.tensor([[1, 5, 77, 300]])
    with torch.no_grad():
        assert torch.equal(got.model(ids).logits, ref(ids).logits)
