"""What a compiled step returns: its traced arrays, and the structure, static leaves and
typed keys that put its result back together around them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from xla_strategies.step.arguments import (
    Declared,
    equinox_numbers_static,
    is_traced,
    unwrap_key,
    wrap_key,
)

if TYPE_CHECKING:
    from xla_strategies.step.in_place_state import WrittenState


@dataclass
class Outputs:
    """What a step returned, apart from its traced arrays: the structure, the static leaves,
    and which traced leaves were typed keys. Filled in while the step is traced."""

    treedef: Any = None
    leaves: tuple[Any, ...] = ()  # a static value, or an ArraySpec-less marker (a key impl)
    names: tuple[str, ...] = ()  # the path of each traced output
    # the argument leaves the step changed in place (NNX variables), returned after the
    # result's traced outputs, with their key types
    written: tuple[int, ...] = ()
    written_keys: tuple[str | None, ...] = ()

    def split(self, result: Any, written: WrittenState | None = None) -> list[Any]:
        """Record `result`'s structure and static leaves; return its traced arrays, then
        the new values of what the step changed in place (`in_place_state`)."""
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(equinox_numbers_static(result))
        traced, leaves, names = [], [], []
        for path, leaf in flat:
            if isinstance(leaf, Declared):  # an equinox module's number comes back as is
                leaves.append(leaf.value)
            elif is_traced(leaf):
                array, impl = unwrap_key(jnp.asarray(leaf))
                traced.append(array)
                leaves.append(_TracedOutput(impl))
                names.append("output" + jax.tree_util.keystr(path))
            else:
                leaves.append(leaf)
        unwrapped = [unwrap_key(jnp.asarray(v)) for v in written.values] if written else []
        self.written = written.indices if written else ()
        self.written_keys = tuple(impl for _, impl in unwrapped)
        names += [f"{name} (in place)" for name in (written.names if written else ())]
        self.leaves, self.names = tuple(leaves), tuple(names)
        return traced + [array for array, _ in unwrapped]

    def traced_indices(self) -> list[int]:
        """Leaf positions of the traced outputs, in order."""
        return [i for i, leaf in enumerate(self.leaves) if isinstance(leaf, _TracedOutput)]

    def in_place(self, arrays: Sequence[Any]) -> list[Any]:
        """The new values of what the step changed in place (keys wrapped)."""
        tail = arrays[len(arrays) - len(self.written) :] if self.written else []
        return [wrap_key(a, impl) for a, impl in zip(tail, self.written_keys, strict=True)]

    def join(self, arrays: Sequence[Any]) -> Any:
        """The step's result from its traced outputs: keys wrapped, static leaves put back."""
        traced = iter(arrays)
        leaves = [
            wrap_key(next(traced), leaf.key_impl) if isinstance(leaf, _TracedOutput) else leaf
            for leaf in self.leaves
        ]
        return jax.tree.unflatten(self.treedef, leaves)


@dataclass(frozen=True)
class _TracedOutput:
    key_impl: str | None
