"""How each output of a differentiated function reduces its rows, read from its jaxpr.

A pipelined loss runs once per microbatch, so an auxiliary output that is a statistic of
the batch (`jnp.sum`, `jnp.max`, `jnp.mean` of its rows) comes out once per microbatch.
Combined by the reduction that made it (a sum of the microbatches' sums, a maximum of
their maxima, a mean of their means, the microbatches being alike in size), it is the
whole batch's statistic. An output made some other way (a standard deviation, a ratio)
is `None` here: no reduction of the microbatches' values gives the batch's.
"""

from __future__ import annotations

import jax.extend.core as jex
import numpy as np

_REDUCTIONS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}
#: equations whose output is their first input's value (cast, copied or laid out)
_SAME_VALUE = ("convert_element_type", "copy", "copy_p", "sharding_constraint")


def reductions(jaxpr: jex.Jaxpr) -> tuple[str | None, ...]:
    """Per output of `jaxpr`, the reduction that made it (`"sum"`, `"max"`, `"min"`, or
    `"mean"`: a sum divided by the count it summed), else None."""
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}

    def producer(v: object) -> jex.JaxprEqn | None:
        eqn = producers.get(v) if isinstance(v, jex.Var) else None
        while eqn is not None and eqn.primitive.name in _SAME_VALUE:
            eqn = producers.get(eqn.invars[0]) if isinstance(eqn.invars[0], jex.Var) else None
        return eqn

    def reduction(v: object) -> str | None:
        eqn = producer(v)
        if eqn is None:
            return None
        if eqn.primitive.name in _REDUCTIONS:
            return _REDUCTIONS[eqn.primitive.name]
        if eqn.primitive.name == "div" and isinstance(eqn.invars[1], jex.Literal):
            summed = producer(eqn.invars[0])
            return "mean" if _divided_by_its_count(summed, eqn.invars[1].val) else None
        return None

    return tuple(reduction(v) for v in jaxpr.outvars)


def _divided_by_its_count(summed: jex.JaxprEqn | None, divisor: object) -> bool:
    """Whether a sum divided by `divisor` is the mean of what it summed (`jnp.mean`), not
    a sum scaled by a constant (`jnp.sum(x) / 2`, which sums over the microbatches)."""
    if summed is None or summed.primitive.name != "reduce_sum":
        return False
    shape = summed.invars[0].aval.shape
    return float(np.prod([shape[a] for a in summed.params["axes"]])) == float(divisor)
