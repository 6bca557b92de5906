"""A rank with no daemon while other ranks of the same digest serve (a TP=2
engine against a TP=1 daemon) is a miss that names the layout fields, not
"no daemon for this digest"."""

from __future__ import annotations

import dataclasses

import pytest
from daemon_support import Daemon, short_dir

pytestmark = pytest.mark.cpu


def _loader(root):
    from preload.loader import LoaderOptions, loader_class

    cls = loader_class()
    loader = cls.__new__(cls)  # no LoadConfig needed for this probe
    loader.opts = LoaderOptions.from_extra({"socket_root": str(root)})
    return loader


def test_missing_rank_names_tp_fields_from_a_sibling_daemon(tiny_ckpt):
    from preload.daemon.raw import raw_key

    root, cache = short_dir(), short_dir()
    daemon = Daemon(tiny_ckpt, root, cache).start()
    try:
        sdir = daemon.socket_dir
        key = dataclasses.replace(raw_key(tiny_ckpt, daemon.ready["digest"], "shm"), tp_size=2, tp_rank=1)
        miss = _loader(root)._other_rank_mismatch(sdir, 1, key, str(tiny_ckpt))
        assert miss is not None
        assert {"tp_size", "tp_rank"} <= set(miss.fields)
        assert "serves ranks [0], not rank 1" in miss.reason
        # Control: a socket dir with no daemon at all stays "no daemon for this digest".
        empty = short_dir()
        assert _loader(root)._other_rank_mismatch(empty, 1, key, str(tiny_ckpt)) is None
    finally:
        daemon.stop()
