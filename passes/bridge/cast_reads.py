"""The dtype a function reads an input as: where every use of the input is a cast to one
narrower float type (a layer that keeps float32 weights and computes in bfloat16), the
input's values matter only as that type. A layer of a stage held in blocks is then
gathered as that type, and its gradient reduce-scattered as that type: what `jax.jit`'s
partitioner moves for the same model, half the bytes of float32."""

from __future__ import annotations

from typing import Any

import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from xla_strategies.passes.bridge import jax_compat

#: calls whose body takes the equation's inputs as its own, one for one
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat2"})


def read_as(jaxpr: jex.Jaxpr, var: Any) -> np.dtype | None:
    """The one narrower float dtype every use of `var` (an input of `jaxpr`) casts it to;
    None where any use reads it otherwise, or it is not used."""
    found = _casts(jaxpr, var)
    if not found or None in found or len(found) != 1:
        return None
    (dtype,) = found
    wide = np.dtype(var.aval.dtype)
    if not jnp.issubdtype(wide, jnp.floating) or dtype.itemsize >= wide.itemsize:
        return None
    return dtype


def _casts(jaxpr: jex.Jaxpr, var: Any) -> set:
    found: set = set()
    if any(v is var for v in jaxpr.outvars):
        found.add(None)
    for eqn in jaxpr.eqns:
        for at, used in enumerate(eqn.invars):
            if used is not var:
                continue
            name = eqn.primitive.name
            if name == "convert_element_type":
                dtype = np.dtype(eqn.params["new_dtype"])
                found.add(dtype if jnp.issubdtype(dtype, jnp.floating) else None)
            elif name in _CALLS:
                body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                inner, _ = jax_compat.jaxpr_parts(body)
                found |= _casts(inner, inner.invars[at]) if body is not None else {None}
            else:
                found.add(None)
    return found
