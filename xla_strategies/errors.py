"""Errors the distributed runtime raises, named as tf.errors names them."""

from __future__ import annotations


class UnavailableError(RuntimeError):
    """A task the cluster needs (a parameter server, say) is gone; the message names it."""


class CancelledError(RuntimeError):
    """A scheduled function never ran: an earlier one failed and the queue was cancelled."""
