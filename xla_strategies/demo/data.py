"""Synthetic token streams made locally, with structure a small LM can learn."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def synthetic_tokens(
    num_batches: int, batch_size: int, seq_len: int, vocab: int, seed: int = 0
) -> Iterator[np.ndarray]:
    """Batches of int32 tokens [batch_size, seq_len + 1] from a fixed random Markov chain.

    Each token has four likely successors, so the achievable loss (about log 4) is far
    below a uniform guess (log vocab): a falling loss means the model learns.
    """
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, size=(vocab, 4))
    for _ in range(num_batches):
        tokens = np.empty((batch_size, seq_len + 1), dtype=np.int32)
        tokens[:, 0] = rng.integers(0, vocab, size=batch_size)
        for t in range(1, seq_len + 1):
            choice = rng.integers(0, 4, size=batch_size)
            tokens[:, t] = successors[tokens[:, t - 1], choice]
        yield tokens
