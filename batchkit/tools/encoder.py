"""The demo's built-in models: small encoders with masked mean pooling.

`NumpyEncoder` needs numpy alone, so the demo runs on the core install: token
embeddings, a feed-forward layer on each token (with a residual), the mean over the
real tokens, then a deep, narrow stack of residual blocks on that vector. Most of
its time is the cost of each call (hundreds of small array operations, whatever the
batch size), as a small model's is on a GPU: that cost is what batching shares.
`torch_encoder` is one layer of torch's `TransformerEncoderLayer` with masked mean
pooling, used when torch is installed. Both take a padded batch of token ids and
its mask and return one float32 vector per row; a row's vector does not depend on
the other rows or on its padding (up to float rounding), which is what lets the demo
check a batched result against the one computed alone.

torch is imported only by `torch_encoder`: ``import batchkit`` never needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np

VOCABULARY = 1000
WIDTH = 64
HIDDEN = 256
DEPTH = 192  # residual blocks on the pooled vector
HEADS = 4
NEEDS_TORCH = 'the torch encoder needs torch: pip install "batchkit-ml[torch]"'

Backend = Literal["auto", "numpy", "torch"]
# (ids [B, L] int64, mask [B, L] bool, True for real tokens) -> [B, WIDTH] float32
Encode = Callable[[np.ndarray, np.ndarray], np.ndarray]


class NumpyEncoder:
    """The encoder in numpy: a per-token feed-forward layer, masked mean pooling, then
    `DEPTH` residual feed-forward blocks.

    Args:
        seed: The seed its weights are drawn with.
    """

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)

        def weight(rows: int, cols: int) -> np.ndarray:
            drawn: np.ndarray = rng.standard_normal((rows, cols)) / np.sqrt(rows)
            return drawn.astype(np.float32)

        self.embed = rng.standard_normal((VOCABULARY, WIDTH)).astype(np.float32)
        self.up, self.down = weight(WIDTH, HIDDEN), weight(HIDDEN, WIDTH)
        self.blocks = [(weight(WIDTH, HIDDEN), weight(HIDDEN, WIDTH)) for _ in range(DEPTH)]

    def __call__(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """One vector per row of `ids`, from its real tokens only.

        Args:
            ids: Token ids, `[batch, length]`, padded.
            mask: `[batch, length]`, True where the token is real.
        """
        x = self.embed[ids]  # [B, L, W]
        x = x + np.maximum(x @ self.up, 0) @ self.down
        weights = mask[:, :, None].astype(np.float32)
        pooled: np.ndarray = (x * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1)
        for up, down in self.blocks:
            pooled = pooled + np.float32(0.1) * (np.maximum(pooled @ up, 0) @ down)
        return pooled


def torch_encoder(seed: int = 0) -> Encode:
    """The encoder in torch (`TransformerEncoderLayer`, one thread, inference mode).

    Args:
        seed: The torch seed its weights are drawn with.

    Raises:
        ImportError: torch is not installed (the message gives the pip command).
    """
    try:
        import torch
    except ImportError:
        raise ImportError(NEEDS_TORCH) from None
    torch.manual_seed(seed)
    embed = torch.nn.Embedding(VOCABULARY, WIDTH)
    layer = torch.nn.TransformerEncoderLayer(WIDTH, HEADS, HIDDEN, dropout=0.0, batch_first=True)
    layer.eval()

    @torch.inference_mode()  # type: ignore[untyped-decorator, misc]
    def encode(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        real = torch.from_numpy(mask)
        hidden = layer(embed(torch.from_numpy(ids)), src_key_padding_mask=~real)
        weights = real.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
        return pooled.numpy()  # type: ignore[no-any-return]

    return encode


def one_blas_thread() -> bool:
    """Put OpenBLAS (what numpy's wheels use) on one thread, for the whole process.

    The demo's model gets one core and its callers the others, as torch's is with
    `torch.set_num_threads(1)`; a multithreaded BLAS on a busy machine makes a large
    matrix product several times slower than on one thread. Best effort: finds the
    library among those the process has loaded (Linux), as threadpoolctl does.

    Returns:
        Whether a BLAS was found and set.
    """
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return False
    for path in sorted(p for p in paths if p.startswith("/")):
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for name in SET_BLAS_THREADS:
            setter = getattr(library, name, None)
            if setter is not None:
                setter(1)
                return True
    return False


SET_BLAS_THREADS = (
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "openblas_set_num_threads",
)


def load_encoder(backend: Backend = "auto", seed: int = 0) -> tuple[str, Encode]:
    """The built-in encoder and its name in words.

    Args:
        backend: `"torch"`, `"numpy"`, or `"auto"`: torch when it is installed, else
            numpy.
        seed: The seed its weights are drawn with.

    Raises:
        ImportError: `backend="torch"` and torch is not installed.
        ValueError: An unknown `backend`.
    """
    if backend not in ("auto", "numpy", "torch"):
        raise ValueError(f'backend must be "auto", "numpy" or "torch", got {backend!r}')
    if backend != "numpy":
        try:
            encode = torch_encoder(seed)
        except ImportError:
            if backend == "torch":
                raise
        else:
            import torch

            torch.set_num_threads(1)  # one core for the model, the rest for the callers
            return "built-in torch encoder", encode
    one_blas_thread()
    model: Any = NumpyEncoder(seed)
    return "built-in numpy encoder", model
