"""A checkpoint's saved tree against the target it is restored into: the leaf paths
both name, and the checks that refuse a restore which would lose or change data (another
structure, another dtype, another shape); and the error for a write the file system
refused."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the path."""


def _plain(tree: Any) -> Any:
    """Orbax's metadata tree as plain dicts and lists (its own classes may not flatten)."""
    if hasattr(tree, "tree") and not hasattr(tree, "shape"):  # orbax's top-level wrapper
        return _plain(tree.tree)
    if hasattr(tree, "keys"):
        return {str(k): _plain(tree[k]) for k in tree.keys()}
    if isinstance(tree, list | tuple):
        return [_plain(v) for v in tree]
    return tree if _is_array(tree) else None  # an array, or an empty node (optax's EmptyState)


def _is_array(leaf: Any) -> bool:
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def _paths(tree: Any) -> set[tuple[str, ...]]:
    """Leaf paths as plain key tokens: orbax's metadata stores tuples as lists and attribute
    names as keys, and drops flax's `.value`, so `[0].count` and `['0']['count']` agree."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_array)[0]
    return {normalized(path) for path, _ in leaves}


_TOKENS = re.compile(r"\[\'?([^\]\']+)\'?\]|\.(\w+)")


def normalized(path: Any) -> tuple[str, ...]:
    """A pytree path as plain key tokens (see `_paths`)."""
    parts = ["".join(m) for m in _TOKENS.findall(jax.tree_util.keystr(path))]
    return tuple(p for p in parts if p != "value")


def check_dtypes(saved: Any, target: Any, where: Path) -> None:
    """Name a leaf whose saved dtype differs from the target's: restoring would cast it
    (float32 weights into int32 lose everything after the point), so it is refused."""
    saved_dtypes = {
        normalized(path): leaf.dtype
        for path, leaf in jax.tree_util.tree_flatten_with_path(_plain(saved), is_leaf=_is_array)[0]
    }
    for path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
        have = _numpy_dtype(saved_dtypes.get(normalized(path)))
        want = _numpy_dtype(getattr(leaf, "dtype", None))
        if have is not None and want is not None and have != want:
            raise CheckpointError(
                f"checkpoint {where} holds {'/'.join(normalized(path))} as {have}, "
                f"the target as {want}; restore into a {have} target "
                f"and cast it yourself if that is what you want"
            )


def check_shapes(saved: Any, wanted: dict[tuple[str, ...], tuple[int, ...]], where: Path) -> None:
    """Name a leaf whose saved shape differs from the shape the restore reads (`wanted`,
    by leaf path): the checkpoint is whole, the target is another model's."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(_plain(saved), is_leaf=_is_array)[0]:
        have = getattr(leaf, "shape", None)
        want = wanted.get(normalized(path))
        if have is not None and want is not None and tuple(have) != tuple(want):
            name = "/".join(normalized(path))
            raise CheckpointError(
                f"checkpoint {where} holds {name} with shape {tuple(have)}, the target with "
                f"shape {tuple(want)}; the checkpoint is whole: restore into a target of the "
                f"saved shape (the model it was saved from)"
            )


def stored_shape(spec: Any) -> tuple[int, ...]:
    """The shape orbax stores a leaf under: a typed PRNG key's is its key data's."""
    if jax.dtypes.issubdtype(spec.dtype, jax.dtypes.prng_key):
        return jax.eval_shape(jax.random.key_data, spec).shape
    return tuple(spec.shape)


def _numpy_dtype(dtype: Any) -> Any:
    """`dtype` as numpy's, or None (none given, or a typed PRNG key: orbax keeps its data)."""
    try:
        return None if dtype is None else jnp.dtype(dtype)
    except TypeError:
        return None


def check_structure(saved: Any, target: Any, where: Path) -> None:
    """Name a pytree path where the checkpoint and the target differ."""
    saved_paths, target_paths = _paths(_plain(saved)), _paths(target)
    if saved_paths != target_paths:
        missing = sorted(saved_paths - target_paths)
        extra = sorted(target_paths - saved_paths)
        show = lambda paths: ["/".join(p) for p in paths[:3]]  # noqa: E731
        detail = (
            f"only in the checkpoint: {show(missing)}"
            if missing
            else f"only in the target: {show(extra)}"
        )
        raise CheckpointError(f"the target's structure differs from checkpoint {where}; {detail}")


def refused_write(what: str, exc: BaseException, kept: int | None) -> CheckpointError | None:
    """A failed write as a `CheckpointError` that says what the OS refused (tensorstore
    reports it as a ValueError carrying the errno) and which step is still the latest
    (`kept`); None for other errors."""
    if not isinstance(exc, OSError | ValueError):
        return None
    code = getattr(exc, "errno", None)
    if code is None:
        found = re.search(r"os_error_code='(\d+)'", str(exc))
        if found is None:
            return None
        code = int(found.group(1))
    reason = f"{errno.errorcode.get(code, code)}: {os.strerror(code)}"
    if code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        reason += " (the disk is full or a file size limit was reached)"
    return CheckpointError(
        f"{what}: the file system refused a write ({reason}); the latest complete "
        f"checkpoint is still {'none' if kept is None else f'step {kept}'}\n{exc}"
    )
