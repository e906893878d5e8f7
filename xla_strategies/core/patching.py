"""`patched`: replace a name in someone else's module, class or table, while any thread
needs it, and put back exactly what was there after the last one is done."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

_lock = threading.Lock()
_patches: dict[tuple[int, Any], list[Any]] = {}  # (id(owner), key) -> [own original, users]
_ABSENT = object()  # the owner did not hold the name itself (absent, or inherited)


@contextlib.contextmanager
def patched(owner: Any, key: Any, replacement: Callable[[Any], Any]) -> Iterator[None]:
    """`owner[key]` (a dict) or `owner.key` is `replacement(current value)` while any
    context in any thread is active; reference-counted, so nested and concurrent users
    share one replacement. A name the owner did not hold itself (a missing dict key, an
    inherited method) is removed again afterwards rather than set to the inherited value.
    """
    if isinstance(owner, dict):
        own = lambda: owner.get(key, _ABSENT)  # noqa: E731
        current = lambda: owner.get(key)  # noqa: E731
        put, drop = owner.__setitem__, owner.pop
    else:
        own = lambda: vars(owner).get(key, _ABSENT)  # noqa: E731
        current = lambda: getattr(owner, key)  # noqa: E731
        put = lambda k, v: setattr(owner, k, v)  # noqa: E731
        drop = lambda k: delattr(owner, k)  # noqa: E731
    slot = (id(owner), key)
    with _lock:
        if slot not in _patches:
            _patches[slot] = [own(), 0]
            put(key, replacement(current()))
        _patches[slot][1] += 1
    try:
        yield
    finally:
        with _lock:
            _patches[slot][1] -= 1
            if _patches[slot][1] == 0:
                original = _patches.pop(slot)[0]
                drop(key) if original is _ABSENT else put(key, original)


@contextlib.contextmanager
def set_in_this_thread(local: threading.local, name: str, value: Any) -> Iterator[None]:
    """`local.name` is `value` in this thread while open, then what it was (absent: None):
    the state a shared `patched` replacement reads for the trace this thread runs."""
    outer = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, outer)
