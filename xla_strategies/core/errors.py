"""Errors the distributed runtime raises, named as tf.errors names them."""

from __future__ import annotations


class UnavailableError(RuntimeError):
    """A task the cluster needs (a parameter server, say) is gone; the message names it."""


class CancelledError(RuntimeError):
    """A scheduled function never ran: an earlier one failed and the queue was cancelled."""


class OutOfRangeError(IndexError):
    """A distributed iterator's `get_next()` was called after its last batch."""


class StoppedAfterCompile(BaseException):  # noqa: N818 - a signal, like KeyboardInterrupt
    """Raised once a step has compiled when `XLA_STRATEGIES_STOP_AFTER_COMPILE` is set.

    A BaseException, so a script's `except Exception` does not swallow it.
    `xla-strategies dump --stop-after-compile` catches it and exits cleanly; the library
    never exits the process itself."""


class OutOfMemoryError(MemoryError):
    """XLA found at compile time that a step does not fit the chip's memory. The message
    names the topology, the chip's HBM, the bytes XLA needs and what shrinks them."""


class DroppedMutationError(ValueError):
    """A step changed one of its arguments in place and did not return the changed value,
    which would be lost: the message names the argument and what to return instead."""
