"""How a compiled step reads its arguments and writes its outputs.

Every leaf of a step's arguments is one of:

- an array (`jax.Array`, numpy array, Python int/float/complex), traced; its `Layout` says
  where it lives and so what each replica sees of it. An abstract one (a
  `jax.ShapeDtypeStruct`, with the sharding that says its layout) is traced too, for
  `step.lower(...)`;
- static: declared with `static_argnums`/`static_argnames`, or any other leaf (a bool flag,
  a string, a function, an equinox module's activation). Static leaves are part of the cache
  key, so they must be hashable, and the step closes over them, as with `jax.jit`'s static
  arguments and `equinox.filter_jit`.

Typed PRNG keys (`jax.random.key`) travel as their key data (`uint32[..., 2]`) and are
wrapped again on both sides, so the IR and the lowering only ever see plain dtypes.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xla_strategies.core.layout import Layout
from xla_strategies.core.state_types import is_state_type
from xla_strategies.core.trees import arg_path, as_array, is_foreign_array


@dataclass(frozen=True)
class ArraySpec:
    """A traced leaf: its global shape and dtype (of the key data, for a typed key); a
    Python number is weakly typed, as under `jax.jit` (`bf16 * 0.5` stays bf16)."""

    shape: tuple[int, ...]
    dtype: str
    layout: Layout
    key_impl: str | None = None
    weak_type: bool = False
    #: the dimension a mirrored array is split on over the model axis (its sharding's)
    model_dim: int | None = None

    @functools.cached_property
    def _hash(self) -> int:
        return hash(
            (self.shape, self.dtype, self.layout, self.key_impl, self.weak_type, self.model_dim)
        )

    def __hash__(self) -> int:  # once per spec: a step's signature hashes every leaf's
        return self._hash


@dataclass(frozen=True)
class Static:
    """A leaf the step closes over, compared by `key`: the value with the type of every
    part, so `True` and `1`, or `(True, 2)` and `(1, 2)`, are different cache keys."""

    key: Any
    value: Any = field(compare=False)


@dataclass(frozen=True)
class Signature:
    """The cache key of a step: argument structure, and each leaf's spec or static value."""

    treedef: Any
    leaves: tuple[ArraySpec | Static, ...]

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.treedef, self.leaves))

    def __hash__(self) -> int:  # once: the executable cache looks a signature up twice a call
        return self._hash

    @functools.cached_property
    def arrays(self) -> list[ArraySpec]:
        """The traced leaves' specs (computed once: donation reads it per state pair)."""
        return [leaf for leaf in self.leaves if isinstance(leaf, ArraySpec)]

    def traced_indices(self) -> list[int]:
        """Leaf positions of the traced arguments, in order."""
        return [i for i, leaf in enumerate(self.leaves) if isinstance(leaf, ArraySpec)]

    def rebuild(self, arrays: Sequence[Any]) -> tuple[tuple, dict]:
        """`(args, kwargs)` from the traced arrays, static values and wrapped keys put back."""
        traced = iter(arrays)
        leaves = []
        for leaf in self.leaves:
            if isinstance(leaf, Static):
                leaves.append(leaf.value.value if isinstance(leaf.value, Declared) else leaf.value)
            else:
                array = next(traced)
                leaves.append(wrap_key(array, leaf.key_impl))
        return jax.tree.unflatten(self.treedef, leaves)


@dataclass(frozen=True)
class Declared:
    """An argument declared static: a leaf as a whole, whatever pytree it is."""

    value: Any


def is_traced(leaf: Any) -> bool:
    """Arrays (another library's too) and Python numbers are traced; bools, strings,
    functions and other objects are not."""
    if isinstance(leaf, bool):
        return False
    return isinstance(
        leaf, jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic | int | float | complex
    ) or is_foreign_array(leaf)


def flatten_arguments(
    args: tuple,
    kwargs: dict,
    layout_of: Callable[[Any], Layout],
    static_argnums: frozenset[int],
    static_argnames: frozenset[str],
    where: Callable[[str], str],
    model_dim_of: Callable[[Any], int | None] = lambda array: None,
    known: KnownSpecs | None = None,
) -> tuple[list[Any], Signature]:
    """The traced arrays of `(args, kwargs)` and the step's signature.

    Args:
        layout_of: the strategy's layout of an array.
        model_dim_of: the dimension the strategy's model axis splits an array on.
        where: turns an argument path (`args[0]['w']`) into the name used in errors.
        known: the specs of arrays read before (a step's own, kept between its calls).
    """
    args = tuple(Declared(a) if i in static_argnums else a for i, a in enumerate(args))
    kwargs = {k: Declared(v) if k in static_argnames else v for k, v in kwargs.items()}
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    if any(_is_number(leaf) for leaf in leaves):  # else both rewrites would change nothing
        args, kwargs = equinox_numbers_static((args, kwargs))
        args, kwargs = _state_numbers_strong((args, kwargs))
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    arrays: list[Any] = []
    specs: list[ArraySpec | Static] = []
    for index, leaf in enumerate(leaves):
        spec = known.get(leaf) if known is not None else None
        if spec is not None:  # an array like one read before: only what can differ checked
            if leaf.is_deleted():
                _refuse_deleted(where(_leaf_path(args, kwargs, index)))
            specs.append(spec)
            arrays.append(leaf)
            continue
        if not is_traced(leaf):
            specs.append(_static(leaf, lambda i=index: where(_leaf_path(args, kwargs, i))))
            continue
        if isinstance(leaf, jax.core.Tracer):
            raise TypeError(
                f"{where(_leaf_path(args, kwargs, index))} is traced: the step was called from "
                "inside a traced function (jax.jit, jax.grad, another compiled step, a loop "
                "body). A compiled step runs a program of its own over every replica and "
                "cannot be traced into another: call it outside the traced function, or call "
                "the plain per-replica function (`step.__wrapped__`) inside a compiled step"
            )
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            _refuse_deleted(where(_leaf_path(args, kwargs, index)))
        if is_foreign_array(leaf):  # read on the host, then placed like a numpy array
            leaf = np.asarray(leaf)
        if isinstance(leaf, np.ndarray):  # of numbers: an object array's error names it
            as_array(leaf, lambda i=index: where(_leaf_path(args, kwargs, i)))
        layout = _layout(layout_of, leaf, lambda i=index: where(_leaf_path(args, kwargs, i)))
        if isinstance(leaf, jax.ShapeDtypeStruct):  # abstract: lowered, never run
            spec = ArraySpec(
                leaf.shape,
                _dtype_name(leaf.dtype),
                layout,
                None,
                leaf.weak_type,
                model_dim_of(leaf),
            )
            specs.append(spec)
            arrays.append(leaf)
            continue
        number = not isinstance(leaf, jax.Array | np.ndarray | np.generic)
        # A Python number is weakly typed, and one out of range fails, as under jax.jit.
        array = jnp.asarray(leaf) if number else leaf
        array, impl = unwrap_key(array)
        # a numpy int64 runs as int32 without x64, as the array the step hands back for it
        dtype = jax.dtypes.canonicalize_dtype(array.dtype) if impl is None else array.dtype
        dim = model_dim_of(leaf)
        spec = ArraySpec(array.shape, _dtype_name(dtype), layout, impl, number, dim)
        concrete = isinstance(leaf, jax.Array) and impl is None  # tracers: refused above
        if known is not None and concrete:
            known.remember(leaf, spec)
        specs.append(spec)
        arrays.append(array)
    return arrays, Signature(treedef, tuple(specs))


class KnownSpecs:
    """The specs of the `jax.Array`s a step has read, by shape, dtype and sharding: all a
    leaf's spec depends on, so a call whose state is the last call's outputs reads each
    leaf with one lookup, and its signature holds the same spec objects (compared by
    identity). Bounded: shapes that change every call cannot grow it forever."""

    LIMIT = 1 << 16

    def __init__(self) -> None:
        self._specs: dict[tuple[Any, ...], ArraySpec] = {}
        self._types: set[type] = set()  # concrete array classes (never a tracer's)

    def get(self, leaf: Any) -> ArraySpec | None:
        if type(leaf) not in self._types:  # numbers, numpy, foreign, abstract, tracers
            return None
        return self._specs.get((leaf.shape, leaf.dtype, leaf.sharding))

    def remember(self, leaf: jax.Array, spec: ArraySpec) -> None:
        if len(self._specs) >= self.LIMIT:
            self._specs.clear()
        self._types.add(type(leaf))
        self._specs[(leaf.shape, leaf.dtype, leaf.sharding)] = spec


def _is_number(leaf: Any) -> bool:
    return isinstance(leaf, int | float | complex) and not isinstance(leaf, bool)


def _refuse_deleted(name: str) -> None:
    raise ValueError(
        f"{name} was donated to an earlier call of a compiled step (donate_argnums or "
        "donate_argnames) and deleted; pass the array that call returned, or donate nothing"
    )


def _layout(layout_of: Callable[[Any], Layout], leaf: Any, where: Callable[[], str]) -> Layout:
    """`layout_of(leaf)`, its refusal (another strategy's batch) naming the argument."""
    try:
        return layout_of(leaf)
    except ValueError as exc:
        raise ValueError(f"{where()}: {exc}") from None


def check_split_rows(signature: Signature, replicas: int, names: Callable[[], list[str]]) -> None:
    """Raise ValueError naming each batch (split) argument whose rows do not divide over
    `replicas`, with its size: shard_map's own error names none of them."""
    uneven = [
        f"{name} has {spec.shape[0]} rows"
        for spec, name in zip(signature.arrays, names(), strict=True)
        if spec.layout is Layout.SPLIT and spec.shape and spec.shape[0] % replicas
    ]
    if uneven:
        raise ValueError(
            f"{', '.join(uneven)}: a batch is split on its first dimension over the "
            f"{replicas} replicas, so its rows must be a multiple of {replicas}"
        )


def _state_numbers_strong(tree: Any) -> Any:
    """Python numbers inside a training state (flax `TrainState.create`'s `step=0`) as
    strongly typed arrays: the step hands them back as such, and a weak type on the first
    call only would compile the step twice (`strategy.replicate` converts them too)."""

    def strong(leaf: Any) -> Any:
        if not isinstance(leaf, int | float) or isinstance(leaf, bool):
            return leaf
        return np.asarray(leaf, jax.dtypes.canonicalize_dtype(np.result_type(leaf)))

    return jax.tree.map(
        lambda x: jax.tree.map(strong, x) if is_state_type(x) else x, tree, is_leaf=is_state_type
    )


def equinox_numbers_static(tree: Any) -> Any:
    """Python numbers inside equinox modules are static, as `eqx.filter_jit` has them (a
    dropout probability, a sequence length used in a shape); elsewhere they are traced, so
    a learning rate that changes does not compile again."""
    eqx = sys.modules.get("equinox")
    if eqx is None:
        return tree

    def declare(module: Any) -> Any:
        return jax.tree.map(
            lambda x: (
                Declared(x)
                if isinstance(x, int | float | complex) and not isinstance(x, bool)
                else x
            ),
            module,
        )

    is_module = lambda x: isinstance(x, eqx.Module)  # noqa: E731
    return jax.tree.map(lambda x: declare(x) if is_module(x) else x, tree, is_leaf=is_module)


def argument_paths(signature: Signature) -> list[str]:
    """The path of each traced leaf, `args[0]['w']` or `kwargs['batch']`."""
    indices = jax.tree.unflatten(signature.treedef, range(len(signature.leaves)))
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(indices)[0]]
    return [
        arg_path(path)
        for path, leaf in zip(paths, signature.leaves, strict=True)
        if isinstance(leaf, ArraySpec)
    ]


def _static(leaf: Any, where: Callable[[], str]) -> Static:
    value = leaf.value if isinstance(leaf, Declared) else leaf
    try:
        hash(value)
    except TypeError as exc:
        if (key := _tree_key(value)) is not None:  # as eqx.filter_jit keys a static part
            return Static(key, leaf)
        kind = "declared static" if isinstance(leaf, Declared) else "not an array, so static"
        raise TypeError(
            f"{where()} is {kind} and must be hashable (it is part of the compile cache key), "
            f"but a {type(value).__name__} is not: {exc}. Pass it as an array, make it "
            "hashable, or close over it in the step"
        ) from None
    return Static(_typed(value), leaf)


def _tree_key(value: Any) -> Any:
    """An unhashable pytree (an `eqx.partition` static part holding a list) keyed by its
    structure and typed leaves, when those hash; None otherwise."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    if treedef.num_nodes == 1:  # a leaf itself: nothing to look inside
        return None
    key = (treedef, tuple(_typed(leaf) for leaf in leaves))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _typed(value: Any) -> Any:
    """`value` with the type of each of its parts, for comparing static values."""
    if isinstance(value, tuple | list | frozenset):
        return (type(value), tuple(_typed(v) for v in value))
    return (type(value), value)


def unwrap_key(array: Any) -> tuple[Any, str | None]:
    if _is_key(array.dtype):
        return jax.random.key_data(array), str(jax.random.key_impl(array))
    return array, None


@functools.cache
def _is_key(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


@functools.cache
def _dtype_name(dtype: Any) -> str:
    return str(dtype)


def wrap_key(array: Any, impl: str | None) -> Any:
    return array if impl is None else jax.random.wrap_key_data(array, impl=impl)


def _leaf_path(args: tuple, kwargs: dict, index: int) -> str:
    path = jax.tree_util.tree_flatten_with_path((args, kwargs))[0][index][0]
    return arg_path(path)
