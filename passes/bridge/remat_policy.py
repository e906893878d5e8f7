"""A step's rematerialised blocks given a policy as they are traced: `compile(remat_policy=NAME)`.

`jax.checkpoint` (flax's `nn.remat`) without a policy keeps a block's inputs alone and
computes everything else again in the backward pass: the least memory, the most recompute.
A policy of `jax.checkpoint_policies` keeps more (`dots_with_no_batch_dims_saveable`: every
weight's matmul output, as MaxText's `remat_policy=minimal`; `everything_saveable`: nothing
is computed again). What a block keeps is decided when autodiff traces it, so the policy is
given there, not by a pass over the captured graph: while the step is traced, every
`remat2` bound without a policy gets the named one; a block with its own keeps it (its
author chose).
"""

from __future__ import annotations

import contextlib
import difflib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax._src import ad_checkpoint  # remat2's primitive: where a block's policy is bound

from xla_strategies.core.patching import patched, set_in_this_thread

#: the policies a block can be given by name: `jax.checkpoint_policies`' plain ones (its
#: factories, such as `save_only_these_names`, take arguments a name cannot carry)
POLICIES = tuple(n for n in dir(jax.checkpoint_policies) if n.endswith("_saveable"))


def checked_policy(name: object, where: str = "remat_policy") -> str:
    """`name` if it names a policy of `POLICIES`; a ValueError naming the closest one."""
    if isinstance(name, str) and name in POLICIES:
        return name
    closest = difflib.get_close_matches(str(name), POLICIES, n=1)
    hint = f"; did you mean {closest[0]!r}?" if closest else ""
    raise ValueError(
        f"{where}={name!r} is not a policy of jax.checkpoint_policies a block can take by "
        f"name{hint} (they are: {', '.join(POLICIES)})"
    )


@contextlib.contextmanager
def given_remat_policy(name: str | None) -> Iterator[Callable[[], tuple[int, int]]]:
    """While open, every remat block this thread binds without a policy gets policy `name`
    (None: none is changed); other threads' blocks are theirs. Yields a function saying
    how many blocks got it and how many kept their own."""
    counts = [0, 0]
    if name is None:
        yield lambda: (0, 0)
        return
    policy = getattr(jax.checkpoint_policies, checked_policy(name))
    with (
        set_in_this_thread(_given, "policy", (policy, counts)),
        patched(ad_checkpoint.remat_p, "bind", _giving_the_threads_policy),
    ):
        yield lambda: (counts[0], counts[1])


_given = threading.local()  # this thread's policy and its counts, while one is given


def _giving_the_threads_policy(original: Callable[..., Any]) -> Callable[..., Any]:
    def bind(*args: Any, **params: Any) -> Any:
        given = getattr(_given, "policy", None)
        if given is not None and not params.get("differentiated"):  # the user's block
            policy, counts = given
            counts[params.get("policy") is not None] += 1
            if params.get("policy") is None:
                params["policy"] = policy
        return original(*args, **params)

    return bind


def warn_if_none_given(name: str | None, given: int, kept: int, step: str) -> None:
    """Say so where `remat_policy=name` was asked for and no block took it: the option
    compiled and changed nothing."""
    if name is None or given:
        return
    what = (
        "each of its remat blocks names its own policy"
        if kept
        else "it has no jax.checkpoint or nn.remat block"
    )
    warnings.warn(f"{step}: remat_policy={name!r} changed nothing: {what}", stacklevel=3)
