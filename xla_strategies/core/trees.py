"""Pytree helpers shared by the strategies: paths for error messages, array checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def path_str(prefix: str, path: tuple[Any, ...]) -> str:
    """`("args", (SequenceKey(0), DictKey('w')))` -> `args[0]['w']`."""
    return prefix + jax.tree_util.keystr(path)


def is_foreign_array(leaf: Any) -> bool:
    """Another library's array that converts to numpy (`__array__`): a torch CPU tensor
    from a DataLoader, say. It is an array, read on the host, never a static value."""
    return hasattr(type(leaf), "__array__") and not isinstance(
        leaf, jax.Array | np.ndarray | np.generic
    )


def as_array(leaf: Any, where: str | Callable[[], str]) -> Any:
    """Return `leaf` as an array (jax.Array kept as is); raise TypeError naming `where`
    (a string, or a function making it, so hot paths format it only on error)."""
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
        raise ValueError(
            f"{_named(where)} was deleted: it was donated to a compiled step "
            "(donate_argnums or donate_argnames), which gave its buffer to the value it "
            "returned; use that returned value"
        )
    if isinstance(leaf, np.ndarray | np.generic) and leaf.dtype.kind in _NOT_NUMERIC:
        raise TypeError(
            f"{_named(where)} is a numpy array of dtype {leaf.dtype}; arrays passed to "
            "replicas hold numbers or bools (convert it, or keep it out of the batch)"
        )
    if isinstance(leaf, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
        return leaf
    if isinstance(leaf, bool | int | float | complex) or is_foreign_array(leaf):
        return np.asarray(leaf)
    where = _named(where)
    raise TypeError(
        f"{where} is a {type(leaf).__name__}, not an array; only arrays (jax.Array, "
        "numpy arrays, array-likes such as torch CPU tensors, or Python numbers) can be "
        "passed to replicas"
    )


# numpy dtype kinds JAX cannot hold: Python objects, strings, bytes (not "V": bfloat16)
_NOT_NUMERIC = frozenset("OUS")


def _named(where: str | Callable[[], str]) -> str:
    return where() if callable(where) else where


def is_function_leaf(leaf: Any) -> bool:
    """A function held as a pytree leaf (an equinox layer's activation, a `custom_jvp`
    such as `jax.nn.relu`): part of the program, not data. It is carried over as it is
    (by `replicate`, into a restored state), never placed or saved."""
    return callable(leaf) and not isinstance(leaf, jax.Array | np.ndarray | type)


def map_arrays(
    fn: Callable[[Any, str], Any], tree: Any, prefix: str, keep_functions: bool = False
) -> Any:
    """`fn(array, path)` on every leaf of `tree`, after checking each leaf is an array;
    with `keep_functions`, function leaves (`is_function_leaf`) are kept as they are."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    results = []
    for path, leaf in leaves:
        if keep_functions and is_function_leaf(leaf):
            results.append(leaf)
            continue
        where = path_str(prefix, path)
        results.append(fn(as_array(leaf, where), where))
    return jax.tree_util.tree_unflatten(treedef, results)


def without_functions(tree: Any) -> Any:
    """`tree` with its function leaves taken out (None, an empty subtree): the data."""
    return jax.tree.map(lambda leaf: None if is_function_leaf(leaf) else leaf, tree)


def with_functions_of(like: Any, data: Any) -> Any:
    """`like`'s structure, with `data`'s leaves (from `without_functions(like)`, in order)
    where `like` holds data and `like`'s own function leaves elsewhere."""
    leaves, treedef = jax.tree_util.tree_flatten(like)
    values = iter(jax.tree.leaves(data))
    merged = [leaf if is_function_leaf(leaf) else next(values) for leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, merged)


def abstract_like(array: Any, sharding: jax.sharding.Sharding) -> jax.ShapeDtypeStruct:
    """`array`'s shape and dtype with `sharding`, as a compile-only strategy holds values."""
    if isinstance(array, jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic):
        return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=sharding)
    dtype = jax.dtypes.canonicalize_dtype(np.result_type(array))  # a Python float: f32
    return jax.ShapeDtypeStruct(np.shape(array), dtype, sharding=sharding)


def copy_to(array: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """A new array with `sharding` that shares no buffer with `array`, so donating it
    never deletes the caller's data (`device_put(may_alias=False)` still aliases the shard
    that stays on the source device, with JAX 0.10)."""
    if isinstance(array, jax.Array):
        array = jax.numpy.copy(array)
    return jax.device_put(array, sharding)


def arg_path(path: tuple[Any, ...]) -> str:
    """Paths of the (args, kwargs) pair read as `args[0]['w']` or `kwargs['batch']`."""
    head, rest = path[0], path[1:]
    return path_str("args" if getattr(head, "idx", 0) == 0 else "kwargs", rest)
