"""The ``preload-gate`` command: every verb, assembled from the layers below."""
