"""Lowering: replay the IR as a jitted `shard_map` over the concrete mesh.

Foreign nodes are bound from their captured equations (the `jax.core.eval_jaxpr` pattern),
known ops go through `jax.lax`, and regions are re-emitted through `lax.scan`,
`lax.while_loop`, `lax.switch` and `jax.checkpoint`: binding the original varying-typed
sub-jaxprs under `check_vma=False` fails. Outputs that vary across replicas come back stacked
on a new leading replica axis; mirrored outputs come back replicated.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from xla_strategies.core.patching import set_in_this_thread
from xla_strategies.passes.bridge import partial_manual, tree_collectives
from xla_strategies.passes.bridge.called_functions import calls_kept, site_function, whole_site
from xla_strategies.passes.bridge.layouts import (
    comes_back_stacked,
    input_shardings,
    manual_over,
    output_shardings,
    value_spec,
)
from xla_strategies.passes.bridge.replay import LoweringError, bind_foreign, recompute_inputs
from xla_strategies.passes.ir.graph import Graph, Node, Value


def lower(
    graph: Graph,
    mesh: Mesh,
    donate_argnums: Sequence[int] = (),
    stacked_mesh: Mesh | None = None,
    compiler_options: dict[str, str] | None = None,
    sharded_mesh: Mesh | None = None,
) -> Callable[..., tuple[jax.Array, ...]]:
    """A jitted function of the flat global arguments that runs `graph` on every replica.

    Inputs and outputs take their layout from the graph: invariant values are replicated,
    varying inputs are split on dim 0 unless the graph marks them stacked (one row per
    replica, squeezed before the graph sees them), and varying outputs come back stacked.
    Stacked values live on `stacked_mesh` (the same devices under reserved axis names), so
    their sharding tells them apart from a split batch; values the graph holds sharded
    (optimizer state under weight-update sharding, parameters under parameter sharding)
    live on `sharded_mesh` for the same reason.
    """
    io = graph.io
    in_specs = tuple(
        value_spec(v, mesh, a.sharded) for v, a in zip(graph.inputs, io.inputs, strict=True)
    )
    out_specs = tuple(
        value_spec(v, mesh, a.sharded) for v, a in zip(graph.outputs, io.outputs, strict=True)
    )
    stacked_in = [a.stacked for a in io.inputs]
    stacked_out = [comes_back_stacked(graph, i) for i in range(len(graph.outputs))]

    calls = calls_kept(mesh.devices.flat[0].platform)

    def body(*flat):
        flat = [x[0] if s else x for x, s in zip(flat, stacked_in, strict=True)]
        with set_in_this_thread(_calling, "kept", calls):  # the regions' graphs' too
            outs = evaluate(graph, flat)
        return tuple(o[None] if s else o for o, s in zip(outs, stacked_out, strict=True))

    program = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        check_vma=False,
        **manual_over(mesh),
    )
    meshes = (mesh, stacked_mesh, sharded_mesh)
    return jax.jit(
        program,
        in_shardings=tuple(input_shardings(graph, *meshes)),
        out_shardings=tuple(output_shardings(graph, *meshes)),
        donate_argnums=tuple(donate_argnums),
        compiler_options=compiler_options or None,
    )


_calling = threading.local()  # `kept`: whether this thread's lowering calls sites again


def evaluate(graph: Graph, args: Sequence[Any]) -> list[Any]:
    """Run `graph` on per-replica values inside a trace; returns its outputs. A call of the
    user's jitted function the passes left whole runs as a call of it again
    (`called_functions`), one function per callee, but for a GPU's program."""
    callees: dict[Any, Callable[..., Any]] = {}
    calls = getattr(_calling, "kept", None) is not False
    env: dict[Value, Any] = dict(zip(graph.inputs, args, strict=True))
    at = 0
    while at < len(graph.nodes):
        site = whole_site(graph.nodes, at) if calls else None
        if site is not None:
            results = site_function(site, callees)(*[env[v] for v in site.inputs])
            env.update(zip(site.outputs, results, strict=True))
            at += len(site.nodes)
            continue
        node = graph.nodes[at]
        rule = _RULES.get(node.op)
        try:
            results = (
                rule(node, [env[v] for v in node.inputs])
                if rule
                else bind_foreign(node, [env[v] for v in node.inputs])
            )
        except LoweringError:
            raise
        except Exception as exc:
            exc.add_note(f"while lowering IR node {node.op} of graph @{graph.name}")
            raise
        env.update(zip(node.outputs, results, strict=True))
        at += 1
    return [env[v] for v in graph.outputs]


def _constant(node: Node, args: list[Any]) -> list[Any]:
    out = node.outputs[0]
    value = node.payload if node.payload is not None else node.attrs["value"]
    if jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.extended):
        return [value]  # a PRNG key: whole, its dtype not one the IR's text names
    return [jnp.broadcast_to(jnp.asarray(value, dtype=out.dtype), out.shape)]


_REDUCERS = {"sum": lax.psum, "mean": lax.pmean, "max": lax.pmax, "min": lax.pmin}


def _all_reduce(node: Node, args: list[Any]) -> list[Any]:
    """One collective for all operands (a tuple bucket is one tuple all-reduce)."""
    reducer = _REDUCERS[node.attrs["reduce_op"]]
    axes = tuple(node.attrs["axes"])
    if all(lax.axis_size(a) == 1 for a in axes):
        # one replica (pipeline stages over every device): nothing to combine, and XLA's
        # partitioner refuses a cross-partition all-reduce over no partitions
        return list(args)
    return list(reducer(list(args), axes))


def _reduce_scatter(node: Node, args: list[Any]) -> list[Any]:
    axes, dim = tuple(node.attrs["axes"]), node.attrs["dimension"]
    if partial_manual.is_partial_manual():  # keeps the operand split over the model axis
        parts = args[0].shape[dim] // node.outputs[0].shape[dim]
        model_dim = node.attrs.get("model_dim")
        return [partial_manual.reduce_scatter(args[0], axes, dim, parts, model_dim)]
    return [lax.psum_scatter(args[0], axes, scatter_dimension=dim, tiled=True)]


def _all_gather(node: Node, args: list[Any]) -> list[Any]:
    axes, dim = tuple(node.attrs["axes"]), node.attrs["dimension"]
    if partial_manual.is_partial_manual():
        parts = node.outputs[0].shape[dim] // args[0].shape[dim]
        model_dim = node.attrs.get("model_dim")
        return [partial_manual.all_gather(args[0], axes, dim, parts, model_dim)]
    return [lax.all_gather(args[0], axes, axis=dim, tiled=True)]


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
    if node.attrs.get("differentiated"):  # the backward's recomputation: run as JAX runs it
        inputs = recompute_inputs(args, node.attrs.get("prevent_cse", True))
        return list(evaluate(node.regions[0], inputs))
    name = node.attrs.get("policy")
    if node.payload is not None:
        policy = node.payload.params.get("policy")
    elif name is None:
        policy = None
    elif name == "custom" or not hasattr(jax.checkpoint_policies, name):
        raise LoweringError(
            f"cannot lower a remat region with policy {name!r} from text: only the policies "
            "named in jax.checkpoint_policies can be rebuilt without the captured program"
        )
    else:
        policy = getattr(jax.checkpoint_policies, name)
    fn = jax.checkpoint(
        lambda *a: evaluate(node.regions[0], a),
        prevent_cse=node.attrs.get("prevent_cse", True),
        policy=policy,
    )
    return list(fn(*args))


def _replica_slice(node: Node, args: list[Any]) -> list[Any]:
    """This replica's block of a mirrored value: block i of dimension `dimension` on replica
    i, numbered over `axes` as tiled collectives number them."""
    dim, block = node.attrs["dimension"], node.outputs[0].shape[node.attrs["dimension"]]
    start = lax.axis_index(tuple(node.attrs["axes"])) * block
    return [lax.dynamic_slice_in_dim(args[0], start, block, axis=dim)]


def _slice(node: Node, args: list[Any]) -> list[Any]:
    return [lax.slice(args[0], node.attrs["start"], node.attrs["limit"])]


def _one_hot_add(node: Node, args: list[Any]) -> list[Any]:
    """`operand + updates` where `dimension` equals the index, `operand` elsewhere."""
    operand, indices, updates = args
    shape, attrs = operand.shape, node.attrs
    index = _placed(indices[..., 0], shape, attrs["index_dims"])
    update = _placed(updates, shape, attrs["update_dims"])
    hit = lax.broadcasted_iota(index.dtype, shape, attrs["dimension"]) == index
    return [jnp.where(hit, operand + update, operand)]


def _placed(x: Any, shape: tuple[int, ...], dims: list[int]) -> Any:
    """`x` broadcast to `shape`, its dimension i at `dims[i]` (-1: a unit dimension, dropped)."""
    kept = [i for i, d in enumerate(dims) if d >= 0]
    targets = [dims[i] for i in kept]
    order = sorted(range(len(kept)), key=targets.__getitem__)
    x = jnp.transpose(jnp.reshape(x, [x.shape[i] for i in kept]), order)
    return lax.broadcast_in_dim(x, shape, sorted(targets))


_RULES: dict[str, Callable[[Node, list[Any]], list[Any]]] = {
    "constant": _constant,
    "pvary": lambda node, args: list(args),
    "pinvariant": lambda node, args: list(args),  # under check_vma=False, types are ours
    "axis_index": lambda n, a: [lax.axis_index(tuple(n.attrs["axes"]))],
    "all_reduce": _all_reduce,
    "reduce_to_one": _reduce_to_one,
    "broadcast": lambda n, a: [
        tree_collectives.broadcast(a[0], n.attrs["axes"][0], n.attrs["size"], n.attrs["root"])
    ],
    "reduce_scatter": _reduce_scatter,
    "all_gather": _all_gather,
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
    "one_hot_add": _one_hot_add,
    "after": lambda n, a: [lax.optimization_barrier(tuple(a))[0]],
    "replica_slice": _replica_slice,
    "reshape": lambda n, a: [jnp.reshape(a[0], n.outputs[0].shape)],
    "transpose": lambda n, a: [jnp.transpose(a[0], n.attrs["permutation"])],
    "add": lambda n, a: [sum(a[1:], a[0])],
    "scale": lambda n, a: [a[0] * np.asarray(n.attrs["factor"], dtype=n.outputs[0].dtype)],
    "convert": lambda n, a: [a[0].astype(n.outputs[0].dtype)],
    "jax.scan": _scan,
    "jax.while": _while,
    "jax.cond": _cond,
    "jax.remat2": _remat,
}
