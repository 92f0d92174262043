"""batchkit on Ray: Ray Data for offline inference, Ray Serve for online serving.

- `BatchkitPredictor`: a callable class for ``Dataset.map_batches`` that
  regroups each block's rows by a batchkit policy (sorted or bucketed by length:
  less padding than Ray's fixed ``batch_size``), collates, runs the model and
  returns the outputs in the block's row order.
- `RayMetrics`: batchkit's metrics (the names of `batchkit.metrics`)
  recorded through Ray's metrics agent, tagged per Serve deployment and replica,
  scraped from the same endpoint as Serve's own ``ray_serve_*`` metrics.
- `replica_stats`: a ``@batched`` function's `Stats` plus the
  Serve replica it lives in, for a deployment's ``stats()`` method.

`BatchkitPredictor` needs no Ray to import or call (so it can be tested on a
single batch); the other two import Ray when used. See ``docs/scaling.md``.
"""

from batchkit.integrations.ray.data import BatchkitPredictor
from batchkit.integrations.ray.serve import RayMetrics, ReplicaStats, replica_stats

__all__ = ["BatchkitPredictor", "RayMetrics", "ReplicaStats", "replica_stats"]
