"""Ray Data: a batchkit pipeline (policy + collator + model) as a ``map_batches`` class.

Ray Data hands ``map_batches`` fixed-size slices of a block in row order, so a
batch of variable-length sequences is padded to its longest row. Here each slice
is regrouped by a batchkit policy first: a ``SortedBatcher`` or ``BucketedBatcher``
puts rows of similar length together, so the model sees little padding; the
results are put back in the slice's row order before they leave.

```python
# not run (needs a Ray cluster; see examples/ray_data_offline.py)
ds = ds.map_batches(
    BatchkitPredictor,
    fn_constructor_kwargs={
        "model_factory": load_model,                      # called once per actor
        "policy": batchkit.SortedBatcher(batch_size=32, max_tokens=8192),
        "collate": batchkit.pad,
        "columns": "input_ids",
    },
    batch_size=1024,                                     # rows regrouped per call
    compute=ray.data.ActorPoolStrategy(size=4),          # actors (one model each)
)
```
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from batchkit._backend import is_tensor
from batchkit.batchers.base import Batcher

ModelFactory = Callable[[], Callable[[Any], Any]]


class BatchkitPredictor:
    """A callable class for ``Dataset.map_batches``, run by an actor pool.

    Every call takes one Ray batch (``dict[str, np.ndarray]``), makes one item per
    row, groups the items with ``policy.batches`` and runs each group as
    ``split(model(collate(items)))``, the same contract as ``@batched``. Results go
    back in row order.

    The policy's ``max_batch_size``/``max_tokens`` size the model's batches; Ray's
    ``batch_size`` is how many rows are regrouped at once (larger: less padding).

    Args:
        model_factory: Builds the model, once per actor (load weights, move them to
            the GPU there); the model takes a batch and returns its results.
        policy: A batchkit policy ([`SortedBatcher`][batchkit.SortedBatcher],
            [`BucketedBatcher`][batchkit.BucketedBatcher], ...) that groups the rows.
        collate: Turns a group's items into the model's input (e.g.
            [`pad`][batchkit.collate.pad.pad]); ``None``: the model gets the list of
            items.
        split: Turns the model's output into one result per item (e.g.
            ``Padded.unpad``); ``None``: the model returns one result per item.
        columns: The column whose value is each row's item, or several names: then
            each item is a dict of those columns.
        output_column: The column the results go to (results that are dicts give
            one column per key instead).
        keep_columns: Return the input columns beside the results.

    Raises:
        TypeError: ``policy`` is not a batchkit policy.
        ValueError: ``columns`` is an empty list.
    """

    def __init__(
        self,
        model_factory: ModelFactory,
        *,
        policy: Batcher,
        collate: Callable[[list[Any]], Any] | None = None,
        split: Callable[[Any], Sequence[Any]] | None = None,
        columns: str | Sequence[str] = "input_ids",
        output_column: str = "output",
        keep_columns: bool = True,
    ) -> None:
        if not isinstance(policy, Batcher):
            raise TypeError(f"policy must be a batchkit Batcher, got {type(policy).__name__}")
        if isinstance(columns, str):
            self.columns: str | tuple[str, ...] = columns
        else:
            self.columns = tuple(columns)
            if not self.columns:
                raise ValueError("columns must name at least one column")
        self.model = model_factory()
        self.policy = policy
        self.collate = collate
        self.split = split
        self.output_column = output_column
        self.keep_columns = keep_columns
        # Running totals for this actor, in the policy's key units (tokens).
        self.rows = 0
        self.model_calls = 0
        self.tokens = 0.0
        self.padded_tokens = 0.0

    @property
    def padding_waste(self) -> float:
        """Share of the padded area (batch size x longest key, summed) that was padding."""
        return 1.0 - self.tokens / self.padded_tokens if self.padded_tokens else 0.0

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one Ray batch; the returned columns are in the batch's row order.

        Args:
            batch: Ray's batch: column name to a numpy array of rows.

        Raises:
            ValueError: The model (and ``split``) returned a number of results other
                than the group's items.
        """
        items = self._items(batch)
        results: list[Any] = [None] * len(items)
        for group in self.policy.batches(items):
            outputs = self._run(list(group))
            for i, out in zip(group.indices, outputs):
                results[i] = out
            keys = [self.policy.key_of(it) for it in group]
            self.model_calls += 1
            self.tokens += sum(keys)
            self.padded_tokens += len(keys) * max(keys)
        self.rows += len(items)
        out_cols = dict(batch) if self.keep_columns else {}
        out_cols.update(self._columns(results))
        return out_cols

    def _items(self, batch: Mapping[str, np.ndarray]) -> list[Any]:
        if isinstance(self.columns, str):
            return list(batch[self.columns])
        cols = [batch[c] for c in self.columns]
        return [dict(zip(self.columns, row)) for row in zip(*cols)]

    def _run(self, items: list[Any]) -> Sequence[Any]:
        out = self.model(items if self.collate is None else self.collate(items))
        results = out if self.split is None else self.split(out)
        if len(results) != len(items):
            raise ValueError(
                f"the model (and split) returned {len(results)} results for {len(items)} items"
            )
        return results

    def _columns(self, results: list[Any]) -> dict[str, np.ndarray]:
        if results and all(isinstance(r, Mapping) for r in results):
            return {k: to_column([r[k] for r in results]) for k in results[0]}
        return {self.output_column: to_column(results)}


def to_column(values: list[Any]) -> np.ndarray:
    """One output column: stacked when every value has one shape, else an object array
    holding one array per row (Ray stores that as a variable-shaped tensor column).

    Args:
        values: One result per row (arrays, tensors or numbers).
    """
    arrays = [_to_numpy(v) for v in values]
    shapes = {a.shape for a in arrays}
    if len(shapes) == 1:
        return np.stack(arrays)
    column = np.empty(len(arrays), dtype=object)
    for i, a in enumerate(arrays):  # slice assignment would try to broadcast the arrays
        column[i] = a
    return column


def _to_numpy(value: Any) -> np.ndarray:
    if is_tensor(value):
        return np.asarray(value.detach().cpu().numpy())
    return np.asarray(value)
