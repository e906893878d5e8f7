"""Lowering: replay the IR as a jitted `shard_map` over the concrete mesh.

Foreign nodes are bound from their captured equations (the `jax.core.eval_jaxpr` pattern),
known ops go through `jax.lax`, and regions are re-emitted through `lax.scan`,
`lax.while_loop`, `lax.switch` and `jax.checkpoint`: binding the original varying-typed
sub-jaxprs under `check_vma=False` fails. Outputs that vary across replicas come back stacked
on a new leading replica axis; mirrored outputs come back replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xla_strategies.passes import tree_collectives
from xla_strategies.passes.ir import Graph, Node, Value


class LoweringError(RuntimeError):
    """The graph cannot be turned into a JAX program."""


def output_spec(value: Value, mesh: Mesh) -> PartitionSpec:
    """Per-replica (varying) outputs are stacked on the replica axis; mirrored ones are whole."""
    if not value.varying_axes:
        return PartitionSpec()
    axes = tuple(mesh.axis_names)
    return PartitionSpec(axes if len(axes) > 1 else axes[0])


def lower(
    graph: Graph, mesh: Mesh, in_specs: Sequence[PartitionSpec], donate_argnums: Sequence[int] = ()
) -> Callable[..., tuple[jax.Array, ...]]:
    """A jitted function of the flat global arguments that runs `graph` on every replica."""
    out_specs = tuple(output_spec(v, mesh) for v in graph.outputs)
    stacked = [bool(v.varying_axes) for v in graph.outputs]

    def body(*flat):
        outs = evaluate(graph, flat)
        return tuple(o[None] if s else o for o, s in zip(outs, stacked, strict=True))

    program = jax.shard_map(
        body, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs, check_vma=False
    )
    return jax.jit(
        program,
        in_shardings=tuple(NamedSharding(mesh, s) for s in in_specs),
        out_shardings=tuple(NamedSharding(mesh, s) for s in out_specs),
        donate_argnums=tuple(donate_argnums),
    )


def evaluate(graph: Graph, args: Sequence[Any]) -> list[Any]:
    """Run `graph` on per-replica values inside a trace; returns its outputs."""
    env: dict[Value, Any] = dict(zip(graph.inputs, args, strict=True))
    for node in graph.nodes:
        rule = _RULES.get(node.op)
        try:
            results = (
                rule(node, [env[v] for v in node.inputs])
                if rule
                else _bind_foreign(node, [env[v] for v in node.inputs])
            )
        except LoweringError:
            raise
        except Exception as exc:
            exc.add_note(f"while lowering IR node {node.op} of graph @{graph.name}")
            raise
        env.update(zip(node.outputs, results, strict=True))
    return [env[v] for v in graph.outputs]


def _bind_foreign(node: Node, args: list[Any]) -> list[Any]:
    if node.payload is None:
        raise LoweringError(
            f"cannot lower foreign node {node.op}: it has no captured JAX equation "
            "(graphs parsed from text can be optimised and printed, not run)"
        )
    eqn = node.payload
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _constant(node: Node, args: list[Any]) -> list[Any]:
    out = node.outputs[0]
    value = node.payload if node.payload is not None else node.attrs["value"]
    return [jnp.broadcast_to(jnp.asarray(value, dtype=out.dtype), out.shape)]


_REDUCERS = {"sum": lax.psum, "mean": lax.pmean, "max": lax.pmax, "min": lax.pmin}


def _all_reduce(node: Node, args: list[Any]) -> list[Any]:
    reducer = _REDUCERS[node.attrs["reduce_op"]]
    return [reducer(x, tuple(node.attrs["axes"])) for x in args]


def _reduce_to_one(node: Node, args: list[Any]) -> list[Any]:
    a = node.attrs
    mean = a["reduce_op"] == "mean"
    return [
        tree_collectives.reduce_to_one(x, a["axes"][0], a["size"], a["root"], mean) for x in args
    ]


def _scan(node: Node, args: list[Any]) -> list[Any]:
    a, region = node.attrs, node.regions[0]
    consts, carry, xs = (
        args[: a["num_consts"]],
        args[a["num_consts"] : a["num_consts"] + a["num_carry"]],
        args[a["num_consts"] + a["num_carry"] :],
    )

    def step(carry, x):
        outs = evaluate(region, [*consts, *carry, *x])
        return outs[: a["num_carry"]], outs[a["num_carry"] :]

    carry, ys = lax.scan(
        step, list(carry), list(xs), length=a["length"], reverse=a["reverse"], unroll=a["unroll"]
    )
    return [*carry, *ys]


def _while(node: Node, args: list[Any]) -> list[Any]:
    nc, nb = node.attrs["cond_nconsts"], node.attrs["body_nconsts"]
    cond_consts, body_consts, init = args[:nc], args[nc : nc + nb], args[nc + nb :]
    cond_region, body_region = node.regions
    return list(
        lax.while_loop(
            lambda c: evaluate(cond_region, [*cond_consts, *c])[0],
            lambda c: evaluate(body_region, [*body_consts, *c]),
            list(init),
        )
    )


def _cond(node: Node, args: list[Any]) -> list[Any]:
    branches = [lambda *ops, r=region: evaluate(r, ops) for region in node.regions]
    return list(lax.switch(args[0], branches, *args[1:]))


def _remat(node: Node, args: list[Any]) -> list[Any]:
    policy = node.payload.params.get("policy") if node.payload is not None else None
    fn = jax.checkpoint(
        lambda *a: evaluate(node.regions[0], a),
        prevent_cse=node.attrs.get("prevent_cse", True),
        policy=policy,
    )
    return list(fn(*args))


def _slice(node: Node, args: list[Any]) -> list[Any]:
    return [lax.slice(args[0], node.attrs["start"], node.attrs["limit"])]


_RULES: dict[str, Callable[[Node, list[Any]], list[Any]]] = {
    "constant": _constant,
    "pvary": lambda node, args: list(args),
    "all_reduce": _all_reduce,
    "reduce_to_one": _reduce_to_one,
    "broadcast": lambda n, a: [
        tree_collectives.broadcast(a[0], n.attrs["axes"][0], n.attrs["size"], n.attrs["root"])
    ],
    "reduce_scatter": lambda n, a: [
        lax.psum_scatter(
            a[0], tuple(n.attrs["axes"]), scatter_dimension=n.attrs["dimension"], tiled=True
        )
    ],
    "all_gather": lambda n, a: [
        lax.all_gather(a[0], tuple(n.attrs["axes"]), axis=n.attrs["dimension"], tiled=True)
    ],
    "all_to_all": lambda n, a: [
        lax.all_to_all(
            a[0], tuple(n.attrs["axes"]), n.attrs["split_axis"], n.attrs["concat_axis"], tiled=True
        )
    ],
    "collective_permute": lambda n, a: [
        lax.ppermute(a[0], tuple(n.attrs["axes"]), [tuple(p) for p in n.attrs["perm"]])
    ],
    "concatenate": lambda n, a: [jnp.concatenate(a, axis=n.attrs.get("dimension", 0))],
    "slice": _slice,
    "reshape": lambda n, a: [jnp.reshape(a[0], n.outputs[0].shape)],
    "add": lambda n, a: [sum(a[1:], a[0])],
    "scale": lambda n, a: [a[0] * np.asarray(n.attrs["factor"], dtype=n.outputs[0].dtype)],
    "convert": lambda n, a: [a[0].astype(n.outputs[0].dtype)],
    "jax.scan": _scan,
    "jax.while": _while,
    "jax.cond": _cond,
    "jax.remat2": _remat,
}
