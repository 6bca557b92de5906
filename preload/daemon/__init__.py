"""The preload daemon: one process per local rank holding that rank's weights.

- :mod:`placement`: which global ranks this node serves (vLLM's rule).
- :mod:`proof`: read each shard once, hashing every byte in that pass.
- :mod:`raw`, :mod:`loaded`: stages that fill an arena through the proof.
- :mod:`lock`, :mod:`server`: one flock and one socket server per rank.
- :mod:`rank`: one rank's process entry point; :mod:`launcher` starts them.
- :mod:`health`: ``/health`` and ``/metrics`` over HTTP.
- :mod:`parent`: stop with the process that started us (ranks; ``--exit-with-parent``).
- :mod:`registry`: the user's private list of live socket roots, for ``status``.
- :mod:`cli`: the ``preload`` and ``status`` verbs.
"""
