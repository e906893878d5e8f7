"""`xs.pipeline_boundary(x)`: where a model whose layers are not a scan marks its stages.

Outside a step traced for pipeline stages it returns `x` itself. Inside one it binds an
identity primitive on `x`'s leaves, which the layer-stack split (`boundary_stack`) finds
in the loss's jaxpr: the equations between two boundaries are one layer of the stack.
Its JVP, transpose, batching and lowering are the identity's, so a boundary left in a
program (a forward pass outside the pipelined gradient) costs nothing.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from xla_strategies.passes.bridge.microbatches import tracing_microbatches

boundary_p = Primitive("pipeline_boundary")
boundary_p.multiple_results = True
boundary_p.def_impl(lambda *xs: list(xs))
boundary_p.def_abstract_eval(lambda *avals: list(avals))
mlir.register_lowering(boundary_p, lambda ctx, *xs: list(xs))
ad.deflinear2(boundary_p, lambda cts, *_: list(cts))
batching.primitive_batchers[boundary_p] = lambda xs, dims: (boundary_p.bind(*xs), dims)


def pipeline_boundary(x: Any) -> Any:
    """Mark `x` (an activation, or a pytree of them) as passing from one layer of the
    model to the next, for pipeline stages (`pipeline_stages=S`) to split a model whose
    layers are not one scan: the layers between consecutive boundaries must be alike
    (the same operations on their own weights of the same shapes), and the first
    boundary follows what every stage runs (the embedding), the last precedes the head.
    Returns `x`.

        h = embed(tokens)
        for block in blocks:
            h = xs.pipeline_boundary(h)
            h = block(h)
        logits = head(xs.pipeline_boundary(h))
    """
    if not tracing_microbatches():
        return x
    leaves, tree = jax.tree.flatten(x)
    return jax.tree.unflatten(tree, boundary_p.bind(*leaves))
