"""The Python side of the ``batchkit`` command: plan and measure before deploying.

- `batchkit.tools.simulate`: replay arrivals against a batcher and a latency
  model, driving the real scheduler with simulated time.
- `batchkit.tools.profile`: sweep batch sizes of a model, find the knee,
  recommend ``max_batch_size`` / ``max_wait_ms``.
- `batchkit.tools.memory`: KV-cache and activation memory, largest batch that fits.
- `batchkit.tools.demo`: the main job, a built-in encoder unbatched vs batched.

The functions are exported at top level (``batchkit.simulate``, ``batchkit.profile``,
``batchkit.kv_cache_bytes``); the modules are not re-exported here so that each
module name keeps meaning the module.
"""
