"""The preload daemon: one process per local rank holding that rank's weights.

- :mod:`placement`: which global ranks this node serves (vLLM's rule).
- :mod:`raw`, :mod:`loaded`: stages that fill an arena while hashing every byte.
- :mod:`server`: the per-rank socket server (flock, peer checks, commands).
- :mod:`rank`: one rank's process entry point; :mod:`launcher` starts them.
- :mod:`health`: ``/health`` and ``/metrics`` over HTTP.
- :mod:`cli`: the ``preload`` and ``status`` verbs.
"""
