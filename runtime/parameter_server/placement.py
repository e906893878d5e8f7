"""Where each variable (or each shard of a split one) lives among the parameter servers.

Variables are the leaves of the parameter pytree. A partitioner may split a leaf along axis
0; the pieces are then dealt to the PS tasks round robin, largest first, so the tasks hold
similar byte counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np


@dataclass(frozen=True)
class Piece:
    name: str  # "<pytree path>#<shard>"
    leaf: int
    start: int
    stop: int
    ps: int


@dataclass(frozen=True)
class Placement:
    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    pieces: tuple[Piece, ...]
    num_ps: int

    @classmethod
    def build(
        cls, params: Any, num_ps: int, partitioner: Callable[..., list[int]] | None = None
    ) -> Placement:
        paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        if not paths_leaves:
            raise ValueError("variables has no arrays")
        pieces = []
        for leaf, (path, value) in enumerate(paths_leaves):
            array = np.asarray(value)
            rows = array.shape[0] if array.ndim else 1
            shards = partitioner(array.shape, array.dtype)[0] if partitioner else 1
            bounds = np.linspace(0, rows, shards + 1).astype(int)
            name, row_bytes = jax.tree_util.keystr(path), array.nbytes // max(rows, 1)
            pieces += [
                ((b - a) * row_bytes, name, i, a, b, leaf)
                for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
            ]
        placed = tuple(
            Piece(f"{name}#{i}", leaf, int(a), int(b), ps=n % num_ps)
            for n, (_, name, i, a, b, leaf) in enumerate(sorted(pieces, key=lambda p: -p[0]))
        )
        shapes = tuple(np.shape(v) for _, v in paths_leaves)
        return cls(treedef, shapes, placed, num_ps)

    def split(self, tree: Any) -> list[dict[str, np.ndarray]]:
        """One dict per PS task of its pieces of `tree` (params or gradients)."""
        leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]
        parts: list[dict[str, np.ndarray]] = [{} for _ in range(self.num_ps)]
        for p in self.pieces:
            leaf = leaves[p.leaf]
            parts[p.ps][p.name] = leaf[p.start : p.stop] if leaf.ndim else leaf
        return parts

    def join(self, parts: list[dict[str, np.ndarray]]) -> Any:
        """The pytree back from the PS tasks' pieces."""
        by_leaf: dict[int, list[Piece]] = {}
        for p in self.pieces:
            by_leaf.setdefault(p.leaf, []).append(p)
        leaves = []
        for leaf, shape in enumerate(self.shapes):
            chunks = [parts[p.ps][p.name] for p in sorted(by_leaf[leaf], key=lambda p: p.start)]
            leaves.append(np.concatenate(chunks) if shape else chunks[0])
        return jax.tree.unflatten(self.treedef, leaves)
