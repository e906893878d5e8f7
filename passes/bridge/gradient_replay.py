"""The step around a pipelined gradient, run on the whole batch.

A step with stages is traced on microbatches (`microbatches.microbatched`), where its
gradients are pipelined (`pipelined_gradients`). Its other outputs, traced there, would be
each microbatch's, and no one rule combines them into the batch's: a mean is right for a
mean, but a sum over the batch's rows came back M times smaller, a maximum as the mean of
the microbatches' maxima, a standard deviation as the mean of theirs. So the step is traced
a second time, on the replica's whole batch, as `jax.jit` runs it: each gradient it takes
there is the one the microbatches pipelined (`Taken`, in the order it took them), not
computed again, and everything else (metrics over the batch, the update) is computed as
written. What the microbatches computed besides the gradients is dead code, which capture
removes.

The loss comes back as the microbatches' mean (with `ReduceOp.SUM` their sum), its
gradient as that of all of them; an auxiliary output with the microbatch's rows first (the
logits) as the batch's rows, in order; a statistic of the microbatch's rows (a sum, a
maximum, a mean) by the same reduction of the microbatches' (`output_reductions`); any
other that depends on the batch as the microbatches' mean (sum: integers, `ReduceOp.SUM`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xla_strategies.passes.bridge.microbatches import combined, per_example
from xla_strategies.passes.bridge.trace_hooks import vma
from xla_strategies.passes.stages.slots import zero_cotangent


@dataclass
class Taken:
    """One gradient the step took on microbatches, as values of the program around them:
    each microbatch's loss (`[M]`), each auxiliary output's leaf (stacked `[M, ...]` where
    `batched`, else its one value), and the cotangent of each flat primal, once the
    pullback has run."""

    losses: Any
    aux: list[Any]
    batched: list[bool]
    aux_tree: Any
    in_tree: Any
    #: per auxiliary leaf, the reduction of its microbatch's rows that made it, if known
    #: (`output_reductions`): the microbatches' values combine by it
    reductions: tuple[str | None, ...]
    cotangents: list[Any] | None = None


@dataclass
class Replay:
    """The gradients to give back, in order, while the step runs on the whole batch."""

    taken: list[Taken]
    rows_per_microbatch: int
    mean: bool
    given: int = 0

    def next(self, fun: Callable[..., Any], primals: tuple, has_aux: bool) -> tuple[Any, ...]:
        """What `jax.vjp(fun, *primals, has_aux=has_aux)` gives the step on the whole
        batch: the next gradient the microbatches took."""
        if self.given >= len(self.taken):
            raise ValueError(
                f"the step takes more gradients on its whole batch than the {len(self.taken)} "
                "it took on one microbatch: a step with stages must take the same gradients "
                "whatever its batch's size"
            )
        taken = self.taken[self.given]
        self.given += 1
        return _replayed(taken, fun, primals, has_aux, self.rows_per_microbatch, self.mean)

    def check_all_given(self) -> None:
        if self.given != len(self.taken):
            raise ValueError(
                f"the step took {len(self.taken)} gradients on one microbatch and {self.given} "
                "on its whole batch: a step with stages must take the same gradients whatever "
                "its batch's size"
            )


def _replayed(
    taken: Taken, fun: Callable[..., Any], primals: tuple, has_aux: bool, rows: int, mean: bool
) -> tuple[Any, ...]:
    flat, in_tree = jax.tree.flatten(tuple(primals))
    if in_tree != taken.in_tree:
        raise ValueError(
            "the step differentiates other arguments on its whole batch than on one "
            f"microbatch: {in_tree} against {taken.in_tree}"
        )
    loss = combined(taken.losses, rows, mean)
    batched = taken.batched
    _warn_of_guessed_combinations(taken, rows)
    aux = [
        combined(a, rows, mean, r) if b else a
        for a, b, r in zip(taken.aux, batched, taken.reductions, strict=True)
    ]
    if not all(batched):
        # an output that does not depend on the batch (the state flax NNX's gradients
        # return: a stream's key, folded per replica in this trace) is this trace's own;
        # the rest of the function is dead code here
        again = jax.tree.leaves(fun(*primals)[1])
        aux = [a if b else x for a, b, x in zip(aux, batched, again, strict=True)]

    def pullback(ct: Any) -> tuple[Any, ...]:
        if taken.cotangents is None:
            raise ValueError("the step called a gradient's pullback on its whole batch only")
        seed = _replicas_seed(ct)
        cts = [_seeded(_as_primal(c, p), seed) for c, p in zip(taken.cotangents, flat, strict=True)]
        return tuple(jax.tree.unflatten(in_tree, cts))

    aux_tree = jax.tree.unflatten(taken.aux_tree, aux)
    return (loss, pullback, aux_tree) if has_aux else (loss, pullback)


def _warn_of_guessed_combinations(taken: Taken, rows: int) -> None:
    """Say which auxiliary outputs come back as the microbatches' mean (or sum) for want
    of a rule that gives the batch's: neither one row per example nor a statistic of the
    rows `output_reductions` reads (a standard deviation, a ratio of two sums)."""
    paths = jax.tree_util.tree_flatten_with_path(
        jax.tree.unflatten(taken.aux_tree, range(len(taken.aux)))
    )[0]
    guessed = [
        jax.tree_util.keystr(path)
        for (path, _), value, batched, by in zip(
            paths, taken.aux, taken.batched, taken.reductions, strict=True
        )
        if batched and by is None and not per_example(value, rows)
    ]
    if guessed:
        warnings.warn(
            f"with pipeline stages, the loss's auxiliary output{'s' * (len(guessed) > 1)} "
            f"{', '.join(guessed)} come{'s' * (len(guessed) == 1)} back as the "
            "microbatches' mean (integers: their sum), which is not the whole batch's: "
            "neither one row per example nor a sum, maximum, minimum or mean of the rows; "
            "return its parts (sums) and combine them after the gradient",
            stacklevel=2,
        )


def _replicas_seed(ct: Any) -> Any:
    """The seed the step gave the loss's pullback (`jax.grad`'s 1, a loss scale), the same
    on every replica. The microbatches' gradients, taken with seed 1, were summed across
    the replicas inside the stages, so the seed multiplies the sum: exact when every
    replica seeds alike. Where replicas seed differently (a seed computed from each one's
    loss) there is no replica's own gradient left to scale: the gradient is NaN, not
    silently another. JAX's own seeds are constants, and the reductions here fold away."""
    (seed,) = jax.tree.leaves(ct)
    axes = tuple(sorted(vma(seed)))
    if not axes:
        return seed
    highest, lowest = jax.lax.pmax(seed, axes), jax.lax.pmin(seed, axes)
    return jnp.where(highest == lowest, highest, jnp.nan)


def _seeded(gradient: Any, seed: Any) -> Any:
    if getattr(gradient, "dtype", None) == jax.dtypes.float0:
        return gradient
    return gradient * jnp.asarray(seed, gradient.dtype)


def _as_primal(cotangent: Any, primal: Any) -> Any:
    """A cotangent of the microbatches as the gradient of the whole batch's `primal`: a
    batch argument's, stacked `[M, rows, ...]`, as the batch's rows."""
    shape = np.shape(primal)
    if np.shape(cotangent) == shape:
        return cotangent
    if getattr(cotangent, "dtype", None) == jax.dtypes.float0:
        return zero_cotangent(primal)
    return cotangent.reshape(shape)
