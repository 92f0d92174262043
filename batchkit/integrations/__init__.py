"""Integrations with other systems, each behind its own optional extra.

- `batchkit.integrations.ray`: Ray Data (offline, ``map_batches``) and Ray
  Serve (online, many replicas); ``pip install "batchkit-ml[ray]"``.

Nothing here is imported by ``import batchkit``.
"""
