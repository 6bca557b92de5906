"""Canaries: golden answers recorded at promotion, checked after every replica start.

The public face is small: :func:`canaries.golden.record`,
:func:`canaries.golden.load_golden` and :func:`canaries.check.check`, and
the ``preload-gate canary record|check`` verbs (:mod:`canaries.cli`).
"""
