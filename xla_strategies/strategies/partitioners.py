"""Variable partitioners for ParameterServerStrategy, as in `tf.distribute.experimental.
partitioners`: each takes a variable's shape and dtype and returns how many shards to
split it into along each axis (only axis 0 is split)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class FixedShardsPartitioner:
    """Split every variable into `num_shards` along axis 0 (fewer if it has fewer rows)."""

    num_shards: int

    def __post_init__(self) -> None:
        _check_positive(num_shards=self.num_shards)

    def __call__(self, shape: tuple[int, ...], dtype: object) -> list[int]:
        rows = shape[0] if shape else 1
        return [min(self.num_shards, rows), *([1] * max(0, len(shape) - 1))]


@dataclass(frozen=True)
class MinSizePartitioner:
    """As many shards as keep each at least `min_shard_bytes`, at most `max_shards`."""

    min_shard_bytes: int = 256 << 10
    max_shards: int = 1

    def __post_init__(self) -> None:
        _check_positive(min_shard_bytes=self.min_shard_bytes, max_shards=self.max_shards)

    def __call__(self, shape: tuple[int, ...], dtype: object) -> list[int]:
        rows = shape[0] if shape else 1
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        shards = max(1, min(self.max_shards, nbytes // self.min_shard_bytes, rows))
        return [shards, *([1] * max(0, len(shape) - 1))]
