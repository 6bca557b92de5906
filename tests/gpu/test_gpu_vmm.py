"""VMM arenas on the GPU: zero copy proven by pointers, read-only engine
mappings, and an allocation that outlives the process that made it while only
a plain fd to it is held by a process with no CUDA context."""

from __future__ import annotations

import time

import pytest
from fd_holder import request
from gpu_support import fd_holder, probe, running_daemon, spec_for

pytestmark = pytest.mark.gpu


def _free() -> int:
    import torch

    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def test_an_fd_held_by_a_process_with_no_cuda_context_keeps_the_allocation() -> None:
    """The allocator deposits its arena's fd with a holder that never loads the
    CUDA driver, then exits with no cleanup. 1 GiB stays allocated, and a third
    process imports it and proves every byte; control: once the holder closes
    the fd, the same measurement sees the memory come back."""
    import torch

    torch.empty(1, device="cuda")
    with fd_holder() as (path, first):
        assert first["libcuda_mapped"] is False
        free0 = _free()
        made = probe({"action": "allocate_deposit", "holder": path, "mib": 1024})
        assert made["event"] == "result" and made["deposited"] is True, made
        alloc = made["alloc_bytes"]
        assert alloc % made["granularity"] == 0 and alloc >= 1 << 30
        status, _ = request(path, {"cmd": "status"})
        # The allocator is gone (probe() returns after it exited); the holder has no CUDA in it.
        assert status["holding"] is True and status["libcuda_mapped"] is False, status
        assert "torch" not in status["modules"] and not any(m.startswith("cuda") for m in status["modules"])
        held = free0 - _free()
        assert held >= 0.95 * alloc, (held, alloc)
        adopted = probe({"action": "adopt", "holder": path})
        assert adopted["event"] == "result", adopted
        assert adopted["proof"]["method"] == "checksum" and adopted["proof"]["tensors"] == 8, adopted
        request(path, {"cmd": "drop"})
        time.sleep(0.5)
        back = _free() - (free0 - held)
        assert back >= 0.95 * alloc, ("the last fd closed: the allocation is freed", back, alloc)


def test_a_read_only_attach_is_zero_copy_and_a_write_through_it_faults(tiny_checkpoint) -> None:
    """An engine that never writes maps the arena PROT_READ: its views start at
    the mapped pointer (no copy), a write through them faults in that engine,
    and the daemon's bytes are unchanged for the next one. The control, a
    read-write attach whose write lands, is
    test_gpu_transport's test_a_write_by_an_earlier_zero_copy_engine_is_caught."""
    ckpt = tiny_checkpoint(arch="llama")
    with running_daemon(ckpt) as ready:
        ro = probe(spec_for(ready, ckpt, "attach", writable=False, verify=True))
        rw = probe(spec_for(ready, ckpt, "attach", writable=True))
        bad = probe(spec_for(ready, ckpt, "attach", writable=False, corrupt="model.norm.weight"))
        after = probe(spec_for(ready, ckpt, "attach", verify=True, compare_disk=True))
    assert ro["event"] == "result" and ro["verify"] == "ok", ro
    assert ro["access"] == "read", ro  # the driver grants PROT_READ on the owning GPU
    assert rw["access"] == "readwrite", rw
    assert ro["ptr_equal"] is True and rw["ptr_equal"] is True
    assert "corrupted" not in bad and "corrupt_error" in bad, bad
    assert after["verify"] == "ok" and after["equal_to_disk"] is True, after
