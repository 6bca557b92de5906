"""pgbase: what every layer of preload-gate shares, and nothing above it.

One module per concern, each importable without torch or vLLM:

- :mod:`pgbase.errors`: the typed failures (``PreloadGateError`` and its
  children) that the CLI prints as one line;
- :mod:`pgbase.atomic`: whole-or-nothing file writes (manifests, reports,
  golden files, fixtures);
- :mod:`pgbase.fileset`: which weight files vLLM's loader reads;
- :mod:`pgbase.shards`: that shard set and each shard's safetensors header,
  valid by the safetensors library's own rules.
- :mod:`pgbase.dtypes`: the one dtype table (the dtypes safetensors and
  torch share, built from their own tables); its safetensors half needs no
  torch, its torch half imports torch when first asked;
- :mod:`pgbase.digest_text`: the one reader of a SHA-256 digest handed to
  us as text (a flag, a config key, a manifest, a golden, a reply);
- :mod:`pgbase.procs`: stopping a child's whole process group (SIGTERM,
  wait, SIGKILL, reap the leader);
- :mod:`pgbase.survivor`: what bench, gate, demo and canary record start
  (processes, FUSE mounts) ends with them, ``kill -9`` included.

``fixtures`` and ``preload`` stand on this package; it imports neither
(tests/unit/test_import_graph.py holds the arrows).
"""
