"""preload: content-keyed weight preloading for vLLM.

The public face is small, and each name lives in its own module:
``preload.promote.promote`` (hash a checkpoint and record its manifest) and
``preload.identity.anchors.fingerprints`` (compare two checkpoints under every
anchor scheme). The daemon and loader are reached through ``preload-gate
preload`` and ``--load-format verified_cache``.

This package imports nothing: an engine that imports ``preload.client`` must
not import promotion and every anchor scheme with it (the first attach paid
17 ms for them; ``tests/unit/test_import_cost.py`` holds it). Nor does it
re-export ``promote``: the name is also its submodule's, and Python binds a
package attribute to the submodule once it is imported.
"""
